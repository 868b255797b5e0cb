"""Sends one streaming request to an OpenAI-compatible endpoint and times every chunk."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from fleetserve.loadtest.datasets import RequestSpec

Api = Literal["chat", "completions"]
# Statuses a server uses to turn work away: rate limited, overloaded.
REFUSAL_STATUSES = (429, 503)
# Response headers recorded per request (fleetserve names the model, replica, pool and routing reason it
# chose); any other server simply sends none.
ROUTING_HEADER_PREFIX = "x-fleetserve-"


# The error of a 200 stream that ended normally without content (a random model can emit only tokens that
# detokenize to nothing).
EMPTY_STREAM = "the stream ended without any content"
# A stream that stopped before `data: [DONE]` (its server died, or a proxy closed it): its output is partial.
CUT_STREAM = "the stream ended before data: [DONE]"


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
    payload: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "stream": True,
                               "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        payload["ignore_eos"] = True
    if spec.group_id is not None:
        # OpenAI's end-user field: one "conversation" per prefix group, for session-affinity routing.
        payload["user"] = f"group-{spec.group_id}"
    if api == "chat":
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    return payload


def _content(event: dict[str, Any], api: Api) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if api == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


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
                event = json.loads(data)
                if "error" in event:
                    record.error = f"stream error: {event['error'].get('message', event['error'])}"
                    return record
                now = time.perf_counter()
                text = _content(event, api)
                if text:
                    if record.ttft is None:
                        record.ttft = now - sent
                    else:
                        record.itl.append(now - last)
                    record.chunk_times.append(now - run_start)
                    pieces.append(text)
                    last = now
                usage = event.get("usage")
                if usage:
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    record.output_tokens = int(usage.get("completion_tokens") or 0)
                    record.usage_from_server = True
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.cached_tokens = int(details["cached_tokens"])
        record.e2el = time.perf_counter() - sent
        record.output_text = "".join(pieces)
        record.ok = record.ttft is not None and done
        if not record.ok:
            record.error = CUT_STREAM if not done else EMPTY_STREAM
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as error:
        record.error = f"{type(error).__name__}: {error}"
    return record
