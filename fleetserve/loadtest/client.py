"""Sends one streaming request to an OpenAI- or Anthropic-compatible endpoint and times every chunk."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from fleetserve.loadtest.datasets import RequestSpec

Api = Literal["chat", "completions", "messages", "responses"]
# Each API's path under /v1, and the field that bounds its output.
API_PATHS: dict[str, str] = {"chat": "chat/completions", "completions": "completions", "messages": "messages",
                             "responses": "responses"}
_MAX_TOKENS_FIELDS = {"chat": "max_tokens", "completions": "max_tokens", "messages": "max_tokens",
                      "responses": "max_output_tokens"}
# APIs without vLLM's ignore_eos (Anthropic's request has no such field).
NO_IGNORE_EOS = ("messages",)
# Statuses a server uses to turn work away: rate limited, overloaded.
REFUSAL_STATUSES = (429, 503)
# Response headers recorded per request (fleetserve names the model, replica, pool and routing reason it
# chose); any other server simply sends none.
ROUTING_HEADER_PREFIX = "x-fleetserve-"


# The error of a 200 stream that ended normally without content (a random model can emit only tokens that
# detokenize to nothing).
EMPTY_STREAM = "the stream ended without any content"
# A stream that stopped before its end (`data: [DONE]`, Anthropic's `message_stop`, the Responses API's
# `response.completed`): its server died, or a proxy closed it, so its output is partial.
CUT_STREAM = "the stream ended before its end event"


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; ``start`` is relative to the run's start."""

    ok: bool = False
    # Error text for failed requests ("HTTP 503: ..." or the exception).
    error: str | None = None
    status_code: int | None = None
    # The server's Retry-After, in seconds, on a refusal (429 or 503).
    retry_after: float | None = None
    start: float = 0.0
    # Time to first content token.
    ttft: float | None = None
    # End-to-end latency: request sent to last byte (a refusal's too: how fast the front door says no).
    e2el: float | None = None
    # Gaps between successive content chunks after the first (a chunk can carry several tokens).
    itl: list[float] = field(default_factory=list)
    # Arrival time of each content chunk, relative to the run's start (for timelines).
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    # Prompt tokens the server served from its prefix cache (usage.prompt_tokens_details.cached_tokens).
    cached_tokens: int | None = None
    # Whether the token counts came from the server's usage (True) or were counted here (False).
    usage_from_server: bool = False
    # Routing headers the server returned (x-fleetserve-model, -replica, -pool).
    routing: dict[str, str] = field(default_factory=dict)
    # The server's x-request-id, to find the request in its logs.
    request_id: str | None = None
    group_id: int | None = None
    output_text: str = ""

    @property
    def refused(self) -> bool:
        """Turned away for load (429 rate limit, 503 overload) rather than failed."""
        return self.status_code in REFUSAL_STATUSES

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM's benchmark defines it."""
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_dict(self, detailed: bool = True) -> dict[str, Any]:
        data = asdict(self)
        data["tpot"] = self.tpot
        if not detailed:
            for key in ("itl", "chunk_times", "output_text"):
                data.pop(key)
        return data


def build_payload(spec: RequestSpec, api: Api, model: str, ignore_eos: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, _MAX_TOKENS_FIELDS[api]: spec.max_tokens, "stream": True,
                               "temperature": 0.0}
    if api in ("chat", "completions"):
        payload["stream_options"] = {"include_usage": True}
    if ignore_eos:
        payload["ignore_eos"] = True
    if spec.group_id is not None:
        # The end-user field (Anthropic's in metadata): one "conversation" per prefix group, for session affinity.
        if api == "messages":
            payload["metadata"] = {"user_id": f"group-{spec.group_id}"}
        else:
            payload["user"] = f"group-{spec.group_id}"
    if api == "completions":
        payload["prompt"] = spec.prompt
    elif api == "responses":
        payload["input"] = spec.prompt
    else:
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    return payload


@dataclass
class StreamEvent:
    """What one server-sent event of an API's stream says."""

    # Output text it carries ("" for none).
    text: str = ""
    # The server's error message, if the event is an error.
    error: str | None = None
    # Whether it is the stream's end event.
    end: bool = False
    # Token counts it carries (prompt, output, cached prompt), None where it says none.
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None


def read_event(event: dict[str, Any], api: Api) -> StreamEvent:
    """The text, error, end and usage of one parsed ``data:`` payload of ``api``'s stream."""
    if api == "messages":
        return _anthropic_event(event)
    if api == "responses":
        return _responses_event(event)
    if "error" in event:
        error = event["error"]
        return StreamEvent(error=str(error.get("message", error) if isinstance(error, dict) else error))
    choices = event.get("choices") or []
    text = ""
    if choices:
        text = ((choices[0].get("delta") or {}).get("content") if api == "chat" else choices[0].get("text")) or ""
    usage = event.get("usage") or {}
    if not usage:
        return StreamEvent(text=text)
    details = usage.get("prompt_tokens_details") or {}
    return StreamEvent(text=text, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                       output_tokens=int(usage.get("completion_tokens") or 0),
                       cached_tokens=details.get("cached_tokens"))


def _anthropic_event(event: dict[str, Any]) -> StreamEvent:
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        return StreamEvent(text=delta.get("text") or "" if delta.get("type") == "text_delta" else "")
    if kind == "message_start":
        usage = (event.get("message") or {}).get("usage") or {}
        cached = int(usage.get("cache_read_input_tokens") or 0)
        # Anthropic's input_tokens leaves out the prompt tokens read from or written to the cache.
        prompt = int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
        return StreamEvent(prompt_tokens=prompt, cached_tokens=cached)
    if kind == "message_delta":
        return StreamEvent(output_tokens=int((event.get("usage") or {}).get("output_tokens") or 0))
    if kind == "error":
        return StreamEvent(error=str((event.get("error") or {}).get("message", event)))
    return StreamEvent(end=kind == "message_stop")


def _responses_event(event: dict[str, Any]) -> StreamEvent:
    kind = event.get("type")
    if kind == "response.output_text.delta":
        return StreamEvent(text=event.get("delta") or "")
    if kind == "response.completed":
        usage = (event.get("response") or {}).get("usage") or {}
        return StreamEvent(end=True, prompt_tokens=int(usage.get("input_tokens") or 0),
                           output_tokens=int(usage.get("output_tokens") or 0),
                           cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens"))
    if kind in ("error", "response.failed"):
        error = event.get("message") or ((event.get("response") or {}).get("error") or {}).get("message")
        return StreamEvent(error=str(error or event))
    return StreamEvent()


async def send_request(http: httpx.AsyncClient, url: str, payload: dict[str, Any], api: Api,
                       run_start: float, spec: RequestSpec | None = None) -> RequestRecord:
    """Streams one request; never raises for request failures, which are recorded instead."""
    record = RequestRecord(group_id=spec.group_id if spec else None)
    sent = time.perf_counter()
    record.start = sent - run_start
    last = sent
    pieces: list[str] = []
    try:
        async with http.stream("POST", url, json=payload) as response:
            record.status_code = response.status_code
            record.request_id = response.headers.get("x-request-id")
            record.routing = {name: value for name, value in response.headers.items()
                                  if name.startswith(ROUTING_HEADER_PREFIX)}
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
                retry_after = response.headers.get("retry-after", "")
                if retry_after.replace(".", "", 1).isdigit():
                    record.retry_after = float(retry_after)
                record.e2el = time.perf_counter() - sent
                return record
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                said = read_event(json.loads(data), api)
                if said.error is not None:
                    record.error = f"stream error: {said.error}"
                    return record
                now = time.perf_counter()
                if said.text:
                    if record.ttft is None:
                        record.ttft = now - sent
                    else:
                        record.itl.append(now - last)
                    record.chunk_times.append(now - run_start)
                    pieces.append(said.text)
                    last = now
                if said.prompt_tokens is not None:
                    record.prompt_tokens = said.prompt_tokens
                    record.usage_from_server = True
                if said.output_tokens is not None:
                    record.output_tokens = said.output_tokens
                    record.usage_from_server = True
                if said.cached_tokens is not None:
                    record.cached_tokens = int(said.cached_tokens)
                if said.end:
                    done = True
                    break
        record.e2el = time.perf_counter() - sent
        record.output_text = "".join(pieces)
        record.ok = record.ttft is not None and done
        if not record.ok:
            record.error = CUT_STREAM if not done else EMPTY_STREAM
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as error:
        record.error = f"{type(error).__name__}: {error}"
    return record
