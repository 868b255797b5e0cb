"""Turns an in-process app's response into the replica chunks the ingress relays: the head with the first
bytes, then coalesced bytes, then the request's usage."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable

from fleetserve.platform.api_types import ApiRequest, ReplicaChunk, ResponseHead, TokenUsage, usage_from
from fleetserve.platform.asgi_call import AppStart

# vLLM's usage event in a chat or completions stream: a chunk with no choices.
_USAGE_MARK = b'"choices":[],'
# vLLM's PRIORITY_HEADER (vllm.entrypoints.generate.base.serving): it overrides the body's priority on chat,
# completions and Responses, and reaches the chat request vLLM converts an Anthropic request into.
VLLM_PRIORITY_HEADER = b"x-vllm-priority"
# How often a call whose response has not started says that its engine made progress (a heartbeat chunk):
# under the ingress's progress_timeout_s, so a long non-streamed answer is not taken for a stuck one.
HEARTBEAT_S = 2.0


def request_headers(request: ApiRequest) -> list[tuple[bytes, bytes]]:
    """Headers the replica's vLLM app gets: the request id, from which vLLM names the response and the
    engine request, and the request's priority where the platform set one."""
    headers = [(b"x-request-id", request.request_id.encode())]
    if request.priority is not None:
        headers.append((VLLM_PRIORITY_HEADER, str(request.priority).encode()))
    return headers


def event_usage(data: bytes, usage: TokenUsage | None = None) -> TokenUsage | None:
    """``usage`` (what a stream's earlier events said) with what the events in ``data`` say: Anthropic's
    ``message_start`` (the prompt) and ``message_delta`` (the output so far), or a Responses
    ``response.completed``. These streams carry usage in events of their own kinds, not OpenAI's usage chunk;
    each count only grows, so the largest seen is the total."""
    found = usage
    for event in data.split(b"\n\n"):
        start = event.find(b"data: ")
        if start < 0 or b'"usage"' not in event:
            continue
        try:
            payload = json.loads(event[start + len(b"data: "):])
        except ValueError:
            continue
        if not isinstance(payload, dict):
            continue
        for holder in (payload, payload.get("response"), payload.get("message")):
            said = usage_from(holder) if isinstance(holder, dict) else None
            if said is not None:
                found = said if found is None else TokenUsage(
                    max(found.num_prompt_tokens, said.num_prompt_tokens),
                    max(found.num_completion_tokens, said.num_completion_tokens))
    return found


def split_usage_event(data: bytes) -> tuple[bytes, TokenUsage | None]:
    """Finds a stream's usage event in ``data``; returns ``data`` without it and the usage it carried."""
    mark = data.find(_USAGE_MARK)
    if mark < 0:
        return data, None
    start = data.rfind(b"data: ", 0, mark)
    end = data.find(b"\n\n", mark)
    if start < 0 or end < 0:
        return data, None
    try:
        usage = usage_from(json.loads(data[start + len(b"data: "):end]))
    except ValueError:
        return data, None
    return data[:start] + data[end + 2:], usage


async def _heartbeats(starting: asyncio.Future, progress: Callable[[], int]) -> AsyncIterator[ReplicaChunk]:
    """A heartbeat chunk each HEARTBEAT_S in which ``progress()`` changed, until ``starting`` is done."""
    seen = progress()
    while not (await asyncio.wait({starting}, timeout=HEARTBEAT_S))[0]:
        now = progress()
        if now != seen:  # grown, or fallen as one of the call's requests finished and left the count
            seen = now
            yield ReplicaChunk(b"", heartbeat=True)


async def relay(events: AsyncIterator[AppStart | bytes], head: ResponseHead, strip_usage: bool = False,
                progress: Callable[[], int] | None = None) -> AsyncIterator[ReplicaChunk]:
    """The replica chunks of one response.

    The first chunk waits for the first body bytes, so an ingress that has it knows the replica started
    streaming (a replica that dies before then can be retried). A last chunk, marked final, carries the
    usage.

    Args:
        events: ``call_app``'s output.
        head: the replica's identity; status and media type are filled in from the app.
        strip_usage: drop a stream's usage event (the ingress asked for it; the client did not).
        progress: the tokens the engine has generated for the call; heartbeats report their growth until
            the response starts.
    """
    if progress is None:
        start = await anext(events)
    else:
        starting = asyncio.ensure_future(anext(events))
        try:
            async for beat in _heartbeats(starting, progress):
                yield beat
        finally:
            if not starting.done():  # the caller left: the app hears of it (call_app's close)
                starting.cancel()
                with contextlib.suppress(BaseException):
                    await starting
        start = starting.result()
    head = dataclasses.replace(head, status_code=start.status_code, media_type=start.media_type)
    usage: TokenUsage | None = None
    body = bytearray()
    first = True
    async for data in events:
        if head.is_stream:
            if _USAGE_MARK in data:
                kept, found = split_usage_event(data)
                usage = found or usage
                data = kept if strip_usage and found is not None else data
            elif b'"usage"' in data:
                usage = event_usage(data, usage)
        else:
            body += data
        if first:
            first = False
            yield ReplicaChunk(data, head=head)
        elif data:
            yield ReplicaChunk(data)
    if first:
        yield ReplicaChunk(b"", head=head)
    if not head.is_stream and head.status_code == 200:
        try:
            usage = usage_from(json.loads(body))
        except ValueError:
            usage = None
    yield ReplicaChunk(b"", usage=usage, final=True)
