"""OpenAI API request models, response builders and error bodies.

Requests are validated here, before they reach an engine, so a bad parameter costs no engine time.
Unknown fields are accepted and ignored, as vLLM's own server does, so newer SDKs keep working.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetserve.platform.engine import GenerationDelta, SamplingOptions, TokenLogprob

# Response headers that say who served a request; `fleetserve bench` records them per request.
HEADER_MODEL = "x-fleetserve-model"
HEADER_REPLICA = "x-fleetserve-replica"
HEADER_POOL = "x-fleetserve-pool"
# Disaggregated models: the prefill replica whose KV the decode replica (x-fleetserve-replica) continued;
# absent when the prompt was short enough to prefill on the decode replica (min_prompt_tokens).
HEADER_PREFILL_REPLICA = "x-fleetserve-prefill-replica"
# Why the replica router chose that replica: cache_hit, load, imbalance, session, round_robin, power_of_two.
HEADER_ROUTE_REASON = "x-fleetserve-route-reason"
# The routed name a cost/quality route resolved (e.g. "auto"), and the strong win rate it computed.
HEADER_ROUTE = "x-fleetserve-route"
HEADER_WIN_RATE = "x-fleetserve-win-rate"
# Clients may name a session for session-affinity routing (the body's `user` field works too).
HEADER_SESSION = "x-session-id"
HEADER_REQUEST_ID = "x-request-id"
ROUTING_HEADERS = (HEADER_MODEL, HEADER_REPLICA, HEADER_POOL, HEADER_PREFILL_REPLICA, HEADER_ROUTE_REASON)


class APIError(Exception):
    """An error the API returns as OpenAI's error JSON."""

    def __init__(self, message: str, status_code: int = 400, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.param = param
        self.code = code
        # Extra response headers, e.g. Retry-After on 429 and 503.
        self.headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # vLLM extension; -1 or 0 disables.
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # vLLM extensions.
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop_token_ids: list[int] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if any(not item for item in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stop

    def _stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_options(self, default_max_tokens: int | None) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self._stops(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self._num_logprobs(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    # Either a string or OpenAI's list of content parts; only text parts are supported.
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's newer name for max_tokens.
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _resolve(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        for message in self.messages:
            message.text()  # raises on non-text parts
        return self

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def rendered_messages(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]


class CompletionRequest(_Request):
    # A string, a list of token ids; a batch of prompts is not supported (n=1 per request).
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt token list must not be empty")
        return prompt

    @model_validator(mode="after")
    def _no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def _num_logprobs(self) -> int | None:
        return self.logprobs


ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def add(self, delta: GenerationDelta) -> None:
        self.prompt_tokens = delta.num_prompt_tokens
        self.cached_tokens = delta.num_cached_tokens
        self.completion_tokens += len(delta.token_ids)


def _finish_reason(delta: GenerationDelta) -> str | None:
    # vLLM reports "abort" for requests it cancelled; OpenAI has no such reason.
    return None if delta.finish_reason == "abort" else delta.finish_reason


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    return {"content": [
        {"token": item.token, "logprob": item.logprob, "bytes": list(item.token.encode()),
         "top_logprobs": [{"token": tok, "logprob": lp, "bytes": list(tok.encode())} for tok, lp in item.top]}
        for item in logprobs]}


def completion_logprobs(logprobs: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    offsets, position = [], text_offset
    for item in logprobs:
        offsets.append(position)
        position += len(item.token)
    return {"tokens": [item.token for item in logprobs],
            "token_logprobs": [item.logprob for item in logprobs],
            "top_logprobs": [dict(item.top) for item in logprobs],
            "text_offset": offsets}


class ResponseBuilder:
    """Turns engine deltas into OpenAI response bodies and stream chunks for one request."""

    def __init__(self, kind: Literal["chat", "completion"], model: str, request_id: str) -> None:
        self.kind = kind
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.usage = Usage()
        self._text_length = 0
        self._sent_role = False

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def chunk(self, delta: GenerationDelta) -> dict[str, Any] | None:
        """One stream chunk for ``delta``; None when it carries nothing to send."""
        self.usage.add(delta)
        finish = _finish_reason(delta)
        if self.kind == "chat":
            message: dict[str, Any] = {}
            if not self._sent_role:
                message["role"] = "assistant"
                self._sent_role = True
            if delta.text:
                message["content"] = delta.text
            if not message and finish is None and delta.logprobs is None:
                return None
            choice = {"index": 0, "delta": message, "logprobs": chat_logprobs(delta.logprobs),
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            if not delta.text and finish is None and delta.logprobs is None:
                return None
            choice = {"index": 0, "text": delta.text, "logprobs": completion_logprobs(delta.logprobs,
                                                                                      self._text_length),
                      "finish_reason": finish}
            obj = "text_completion"
        self._text_length += len(delta.text)
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage.body()}

    def full(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        """The non-streaming response for a finished request."""
        for delta in deltas:
            self.usage.add(delta)
        text = "".join(delta.text for delta in deltas)
        finish = _finish_reason(deltas[-1]) if deltas else None
        logprob_items = [item for delta in deltas for item in (delta.logprobs or [])]
        has_logprobs = any(delta.logprobs is not None for delta in deltas)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": chat_logprobs(logprob_items) if has_logprobs else None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text,
                      "logprobs": completion_logprobs(logprob_items, 0) if has_logprobs else None,
                      "finish_reason": finish}
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage.body()}
