"""The few fields of an OpenAI request body that the ingress reads: the model, the output budget, and the
prompt's text (for limits, rate charges and routing). vLLM validates everything else in the replica."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from starlette.requests import Request

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.api_types import Endpoint, RoutingHints

# The body field that holds the output budget, per endpoint, newest name first.
MAX_TOKENS_FIELDS: dict[Endpoint, tuple[str, ...]] = {
    Endpoint.CHAT: ("max_completion_tokens", "max_tokens"),
    Endpoint.COMPLETIONS: ("max_tokens",),
    Endpoint.RESPONSES: ("max_output_tokens",),
    Endpoint.MESSAGES: ("max_tokens",),
}
# vLLM's own default for a completion's max_tokens.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class RequestFields:
    """What the ingress knows about one request."""

    # The model name the client asked for (a served model, or a routed name like "auto").
    model: str
    # The parsed body, forwarded as the client sent it unless the ingress must change a field.
    payload: dict[str, Any]
    # Chat messages (or Anthropic messages) as role/content text, for routing and limits; None otherwise.
    messages: list[dict[str, str]] | None
    # The completion prompt (text or token ids), or the input text of other endpoints.
    prompt: str | list[int] | None
    # The output budget the body asks for; None leaves it to vLLM (the rest of the context).
    max_tokens: int | None
    stream: bool
    # The outputs the request asks for, each with the whole budget: `n` of each prompt (a completions
    # prompt may be a list of prompts).
    num_sequences: int = 1
    # Prompt text besides the messages or input: tool definitions (as JSON) and Responses instructions. It
    # counts toward the prompt's size; routing reads only what the user wrote.
    context_text: str = ""
    # Whether the endpoint generates output (tokenize, count_tokens and embeddings make none).
    generates: bool = True

    @property
    def num_messages(self) -> int:
        return len(self.messages) if self.messages is not None else 0

    @cached_property
    def prompt_text(self) -> str:
        """The prompt's text, tool definitions included; token ids count as 4 characters each, like the token
        estimate."""
        if self.messages is not None:
            return "".join(message["content"] for message in self.messages) + self.context_text
        if isinstance(self.prompt, list):
            return " " * 4 * len(self.prompt) + self.context_text
        return (self.prompt or "") + self.context_text

    def routing_hints(self, session_id: str | None, adapter: str | None = None) -> RoutingHints:
        """What the replica router reads; ``adapter`` is the LoRA adapter the request names, if any."""
        if self.messages is not None:
            text = "".join(f"<{message['role']}>{message['content']}" for message in self.messages)
        else:
            text = self.prompt if isinstance(self.prompt, str) else " ".join(map(str, self.prompt or []))
        if adapter is not None:
            # vLLM's prefix cache is per adapter: the same prompt under another adapter shares no blocks.
            text = f"<lora:{adapter}>{text}"
        # OpenAI's prompt_cache_key exists to keep one prefix on one cache: it keys affinity, before `user`.
        # Anthropic's clients name their end user (Claude Code: its session) in metadata.user_id.
        metadata = self.payload.get("metadata")
        anthropic_user = metadata.get("user_id") if isinstance(metadata, dict) else None
        keys = (self.payload.get("prompt_cache_key"), self.payload.get("user"), anthropic_user)
        session = session_id or next((key for key in keys if isinstance(key, str) and key), None)
        return RoutingHints(text, session, self.messages, self.prompt, adapter)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, counted as it arrives: a chunked body (no Content-Length) is bounded too.

    Raises:
        APIError: 400 ``request_too_large`` once the body passes ``max_bytes``.
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(f"request body exceeds {max_bytes} bytes, the limit", 400, code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body.

    Raises:
        APIError: 400 for a body that is not a strict JSON object (NaN and Infinity are not JSON).
    """
    def _reject(constant: str) -> None:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        payload = json.loads(body, parse_constant=_reject)
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(f"request body is not valid JSON: {error}", 400) from None
    except RecursionError:
        raise APIError("request body nests too deeply to parse", 400) from None
    if not isinstance(payload, dict):
        raise APIError("request body must be a JSON object", 400)
    return payload


# Keys of a content part, input item or tool call whose values are prompt text: text parts, tool results
# (Anthropic's content, Responses' output), tool calls (OpenAI's function and arguments, Anthropic's input) and
# reasoning. Images and files are not characters, and are not counted.
_TEXT_KEYS = ("text", "content", "output", "function", "arguments", "input", "thinking")
# The fields of a score or rerank request that hold its texts, in vLLM's four shapes of a score request and
# its rerank request. The texts count once each, as sent; a cross-encoder reads the query once per document.
SCORING_TEXT_KEYS = ("query", "queries", "documents", "items", "text_1", "text_2", "data_1", "data_2")
# How deep text is looked for: no API nests its parts more than a few levels (vLLM refuses deeper ones), and
# a hostile body must not exhaust the stack.
MAX_PART_DEPTH = 16


def _part_text(part: Any, depth: int = 0) -> str:
    """The prompt text in one content part, input item or tool call, down to ``MAX_PART_DEPTH`` levels."""
    if isinstance(part, str):
        return part
    if depth >= MAX_PART_DEPTH:
        return ""
    if isinstance(part, list):
        return "".join(_part_text(item, depth + 1) for item in part)
    if not isinstance(part, dict):
        return ""
    texts = []
    for key in _TEXT_KEYS:
        value = part.get(key)
        # A tool call's input is arbitrary JSON, as the model sees it (json.dumps has its own depth check).
        if key == "input" and isinstance(value, dict):
            texts.append(_dumped(value))
        else:
            texts.append(_part_text(value, depth + 1))
    return "".join(texts)


def _dumped(value: Any) -> str:
    try:
        return json.dumps(value)
    except RecursionError:  # parsed from a body, so as deep as json.loads took: count it as nothing
        return ""


def _content_text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return _part_text(content)
    raise APIError(f"{param} must be a string or a list of content parts", 400, param=param)


def _messages(payload: dict[str, Any], key: str) -> list[dict[str, str]]:
    messages = payload.get(key)
    if not isinstance(messages, list) or not messages:
        raise APIError(f"`{key}` must be a non-empty list", 400, param=key)
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise APIError(f"{key}.{index} must be an object", 400, param=f"{key}.{index}")
        role = message.get("role", message.get("type", ""))
        text = _content_text(message.get("content"), f"{key}.{index}.content") + _part_text(message.get("tool_calls"))
        rendered.append({"role": str(role), "content": text})
    return rendered


def _input_text(value: Any, param: str) -> str | list[int] | None:
    """A prompt or input: text, token ids, or a list of texts or items (joined)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return value
    if isinstance(value, list) and any(isinstance(item, bool) or (isinstance(item, list) and any(
            isinstance(token, bool) for token in item)) for item in value):
        # JSON's true/false are not token ids (pydantic would coerce them to 1 and 0).
        raise APIError(f"`{param}` must be text or a list of integer token ids, not booleans", 400, param=param)
    if isinstance(value, list):
        texts = []
        for item in value:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, dict):
                texts.append(_part_text(item))
            elif isinstance(item, list):
                texts.append(" " * 4 * len(item))
        return "".join(texts)
    raise APIError(f"`{param}` must be a string or a list", 400, param=param)


def _max_tokens(endpoint: Endpoint, payload: dict[str, Any]) -> int | None:
    for key in MAX_TOKENS_FIELDS.get(endpoint, ()):
        value = payload.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise APIError(f"`{key}` must be an integer", 400, param=key)
        return value
    return DEFAULT_COMPLETION_MAX_TOKENS if endpoint is Endpoint.COMPLETIONS else None


def _num_sequences(endpoint: Endpoint, payload: dict[str, Any]) -> int:
    """``n`` times the number of prompts; a malformed ``n`` counts as 1 (vLLM refuses it)."""
    if endpoint not in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        return 1
    n = payload.get("n")
    num_choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompt = payload.get("prompt")
    batched = (endpoint is Endpoint.COMPLETIONS and isinstance(prompt, list) and prompt
               and all(isinstance(item, (str, list)) for item in prompt))
    return num_choices * (len(prompt) if batched else 1)


def _context_text(endpoint: Endpoint, payload: dict[str, Any]) -> str:
    """Tool definitions, as JSON, and a Responses request's instructions."""
    tools = payload.get("tools")
    text = json.dumps(tools) if isinstance(tools, list) and tools else ""
    instructions = payload.get("instructions") if endpoint is Endpoint.RESPONSES else None
    return text + (instructions if isinstance(instructions, str) else "")


def read_fields(endpoint: Endpoint, payload: dict[str, Any]) -> RequestFields:
    """The fields the ingress needs from a request to ``endpoint``.

    Raises:
        APIError: 400 naming the field, when the model is missing or a read field has the wrong shape.
    """
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("`model` is required and must be a string", 400, param="model")
    messages = prompt = None
    if endpoint in (Endpoint.CHAT, Endpoint.MESSAGES, Endpoint.COUNT_TOKENS) or (
            endpoint in (Endpoint.TOKENIZE, Endpoint.CLASSIFY) and "messages" in payload):
        messages = _messages(payload, "messages")
        system = payload.get("system") if endpoint.is_anthropic else None
        if system is not None:
            messages.insert(0, {"role": "system", "content": _content_text(system, "system")})
    elif endpoint in (Endpoint.COMPLETIONS, Endpoint.TOKENIZE):
        prompt = _input_text(payload.get("prompt"), "prompt")
    elif endpoint in (Endpoint.RESPONSES, Endpoint.EMBEDDINGS, Endpoint.POOLING, Endpoint.CLASSIFY):
        prompt = _input_text(payload.get("input"), "input")
    elif endpoint in (Endpoint.SCORE, Endpoint.RERANK):
        prompt = "".join(_part_text(payload.get(key)) for key in SCORING_TEXT_KEYS)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # OpenAI refuses it; vLLM's pydantic would read "yes" or 1 as true, and the ingress as a whole response.
        raise APIError("`stream` must be a boolean", 400, param="stream")
    stream = stream is True
    if payload.get("stream_options") is not None and not stream:
        # OpenAI's rule: stream options only mean something on a stream.
        raise APIError("`stream_options` is only allowed when `stream` is true", 400, param="stream_options")
    return RequestFields(model, payload, messages, prompt, _max_tokens(endpoint, payload), stream,
                         _num_sequences(endpoint, payload), _context_text(endpoint, payload), endpoint.generates)
