"""Request parameters that vLLM would accept and then not act on, found before vLLM sees the request.

vLLM's request models allow unknown fields and only log them, and a chat template drops the
``chat_template_kwargs`` (and ``reasoning_effort``, ``documents``) it does not read. A client that sends
OpenAI's ``audio``, ``best_of`` or a removed ``guided_json`` would get free text with a 200. The replica
refuses such a request with a 400 naming the parameter instead.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from fleetserve.platform.api_types import Endpoint

# vLLM's request type per path, as its routes declare them (module, name).
REQUEST_TYPES: dict[Endpoint, tuple[str, str]] = {
    Endpoint.CHAT: ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    Endpoint.COMPLETIONS: ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    Endpoint.RESPONSES: ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
    Endpoint.MESSAGES: ("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest"),
    Endpoint.COUNT_TOKENS: ("vllm.entrypoints.anthropic.protocol", "AnthropicCountTokensRequest"),
    Endpoint.EMBEDDINGS: ("vllm.entrypoints.pooling.embed.protocol", "EmbeddingRequest"),
    Endpoint.POOLING: ("vllm.entrypoints.pooling.pooling.protocol", "PoolingRequest"),
    Endpoint.SCORE: ("vllm.entrypoints.pooling.scoring.protocol", "ScoreRequest"),
    Endpoint.RERANK: ("vllm.entrypoints.pooling.scoring.protocol", "RerankRequest"),
    Endpoint.CLASSIFY: ("vllm.entrypoints.pooling.classify.protocol", "ClassificationRequest"),
    Endpoint.TOKENIZE: ("vllm.entrypoints.serve.tokenize.protocol", "TokenizeRequest"),
    Endpoint.DETOKENIZE: ("vllm.entrypoints.serve.tokenize.protocol", "DetokenizeRequest"),
}
# Read by fleetserve's ingress, not by vLLM: the replica router's affinity key.
PLATFORM_PARAMS = frozenset({"prompt_cache_key"})
# Values that ask for nothing, so need no reader: OpenAI's defaults for parameters vLLM lacks.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {"store": (False,), "service_tier": ("auto", "default"),
                                          # Rerank APIs (Jina, Cohere): vLLM returns the documents always.
                                          "return_documents": (True,)}
# Chat fields that vLLM only hands to the chat template as variables of the same name.
TEMPLATE_FIELDS = ("reasoning_effort", "documents")


@dataclass(frozen=True)
class UnreadParam:
    """One parameter of a request that nothing would act on."""

    # Its dotted path in the body ("audio", "stream_options.foo", "chat_template_kwargs.enable_thinking").
    path: str
    # Who would have dropped it: "vLLM" (no such field) or "the chat template" (no such variable).
    dropped_by: str


@cache
def _request_adapter(endpoint: Endpoint) -> TypeAdapter:
    module, name = REQUEST_TYPES[endpoint]
    return TypeAdapter(getattr(importlib.import_module(module), name))


@cache
def _field_names(model_cls: type[BaseModel]) -> frozenset[str]:
    names = set(model_cls.model_fields)
    names.update(field.alias for field in model_cls.model_fields.values() if field.alias)
    return frozenset(names)


@cache
def _apply_chat_template_params() -> frozenset[str]:
    # The keyword arguments transformers' apply_chat_template takes itself (vLLM passes these through).
    from transformers import PreTrainedTokenizerBase

    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}


def template_variables(chat_template: str) -> frozenset[str]:
    """The variables a Jinja chat template reads."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    # vLLM's renderer adds a {% generation %} tag; it reads no variables, so its body parses as-is here.
    text = chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(text)))


def _extras(value: Any, path: str) -> Iterator[str]:
    """Dotted paths of the fields a validated vLLM object kept as extras, at any depth."""
    if isinstance(value, BaseModel):
        for key, extra in (value.model_extra or {}).items():
            if not _is_no_op(key, extra):
                yield f"{path}{key}"
        for name in type(value).model_fields:
            yield from _extras(getattr(value, name), f"{path}{name}.")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _extras(item, f"{path}{index}.")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _extras(item, f"{path}{key}.")


def _is_no_op(key: str, value: Any) -> bool:
    return value is None or value in NO_OP_VALUES.get(key, ())


class RequestCheck:
    """Finds the parameters of a request that vLLM (or the model's chat template) would not read.

    Args:
        chat_template: the template the model's chat requests render with; None skips the template check.
        schedules_by_priority: whether the engine orders its queue by ``priority`` (vLLM's scheduling_policy
            ``priority``); its first-come-first-served scheduler ignores a request's priority.
    """

    def __init__(self, chat_template: str | None, schedules_by_priority: bool = False,
                 stores_responses: bool = False) -> None:
        self._template_vars = template_variables(chat_template) if chat_template is not None else None
        self._schedules_by_priority = schedules_by_priority
        self._stores_responses = stores_responses

    def unread(self, endpoint: Endpoint, payload: dict[str, Any]) -> list[UnreadParam]:
        """The parameters of ``payload`` that nothing would act on, in body order.

        A body vLLM's own validation refuses yields none: vLLM's 400 then names the problem.
        """
        if endpoint not in REQUEST_TYPES:
            return []
        from vllm.exceptions import VLLMClientError

        try:
            request = _request_adapter(endpoint).validate_python(payload)
        except (ValidationError, ValueError, VLLMClientError):  # vLLM's validators raise its own errors too
            return []
        known = _field_names(type(request)) | PLATFORM_PARAMS
        unread = [UnreadParam(key, "vLLM") for key, value in payload.items()
                  if key not in known and not _is_no_op(key, value)]
        # Top-level extras were found above, including those of models that ignore extras.
        fields = type(request).model_fields
        nested = (path for name in payload if name in fields
                  for path in _extras(getattr(request, name), f"{name}."))
        unread += [UnreadParam(path, "vLLM") for path in nested]
        if endpoint is Endpoint.CHAT and self._template_vars is not None:
            unread += self._unread_by_template(payload)
        if not self._schedules_by_priority and "priority" in known and payload.get("priority") not in (None, 0):
            unread.append(UnreadParam("priority", "the engine's first-come-first-served scheduler"))
        return unread

    def _unread_by_template(self, payload: dict[str, Any]) -> list[UnreadParam]:
        unread = [UnreadParam(name, "the chat template") for name in TEMPLATE_FIELDS
                  if payload.get(name) is not None and name not in self._template_vars]
        kwargs = payload.get("chat_template_kwargs")
        if isinstance(kwargs, dict):
            # transformers acts on its own arguments (continue_final_message), except those it only
            # hands on to the template.
            reads = self._template_vars | (_apply_chat_template_params() - {"documents", "tools"})
            unread += [UnreadParam(f"chat_template_kwargs.{key}", "the chat template")
                       for key in kwargs if key not in reads]
        return unread

    def refusal(self, endpoint: Endpoint, body: bytes) -> bytes | None:
        """OpenAI error JSON (for a 400) naming the unread parameters of ``body``; None when all are read."""
        return self.payload_refusal(endpoint, json_object(body))

    def payload_refusal(self, endpoint: Endpoint, payload: dict[str, Any] | None) -> bytes | None:
        """``refusal`` of a body already parsed (``json_object``)."""
        if payload is None:
            return None
        if endpoint is Endpoint.RESPONSES and payload.get("background") and self._stores_responses:
            # Without the store vLLM refuses it itself; with it, the response is kept where no client can fetch it.
            return _error("A background response is fetched with GET /v1/responses/{id}, which fleetserve cannot "
                          "route to the engine replica that stores it; stream the response instead", "background")
        unread = self.unread(endpoint, payload)
        if not unread:
            return None
        paths = ", ".join(param.path for param in unread)
        dropped_by = " and ".join(dict.fromkeys(param.dropped_by for param in unread))
        return _error(f"Unsupported parameter(s): {paths}. {dropped_by} would ignore them for this model, so they "
                      f"are refused rather than dropped; remove them, or send null for the default", unread[0].path)


def json_object(body: bytes) -> dict[str, Any] | None:
    """``body`` parsed, when it is a JSON object; None otherwise (vLLM answers such a body itself)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _error(message: str, param: str) -> bytes:
    """OpenAI error JSON for a 400 refusing ``param``."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": "unsupported_parameter"}}).encode()
