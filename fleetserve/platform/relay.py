"""Turns an in-process app's response into the replica chunks the ingress relays: the head with the first
bytes, then coalesced bytes, then the request's usage."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from fleetserve.platform.api_types import ApiRequest, Endpoint, ReplicaChunk, ResponseHead, TokenUsage, usage_from
from fleetserve.platform.asgi_call import AppStart

# vLLM's usage event in a chat or completions stream: a chunk with no choices.
_USAGE_MARK = b'"choices":[],'
# vLLM's error event in a chat or completions stream.
ERROR_EVENT = b'data: {"error"'
# vLLM's error event in an Anthropic Messages stream.
ANTHROPIC_ERROR_EVENT = b"event: error\n"


def is_error_event(event: bytes) -> bool:
    """Whether ``event`` (one server-sent event, or what begins with one) is vLLM's error event."""
    return event.startswith((ERROR_EVENT, ANTHROPIC_ERROR_EVENT))


def anthropic_error(error: dict) -> dict:
    """OpenAI's error body in Anthropic's shape, as vLLM's Anthropic server writes its own errors (the type
    passed on as it is)."""
    detail = error["error"]
    return {"type": "error", "error": {"type": detail["type"], "message": detail["message"]}}


def in_anthropic_shape(body: bytes) -> bytes:
    """An error body in OpenAI's shape (fleetserve's own refusals) in Anthropic's; any other body as it is."""
    if not body.startswith(b'{"error"'):
        return body
    try:
        return json.dumps(anthropic_error(json.loads(body))).encode()
    except (ValueError, KeyError, TypeError):
        return body


def error_event(endpoint: Endpoint, error: dict) -> bytes:
    """One server-sent event (without its closing blank line) carrying ``error`` (OpenAI's error body).

    A Messages stream gets Anthropic's error event, with the error's type as vLLM's Anthropic server passes it
    on: Anthropic's SDKs skip events without an ``event:`` line, so OpenAI's form would cut the stream off
    unannounced. Other streams get OpenAI's error data.
    """
    if endpoint is Endpoint.MESSAGES:
        return f"event: error\ndata: {json.dumps(anthropic_error(error), separators=(',', ':'))}".encode()
    return f"data: {json.dumps(error, separators=(',', ':'))}".encode()


def stream_error(endpoint: Endpoint, error: dict) -> bytes:
    """The events that end a stream of ``endpoint`` with ``error``: ``error_event``, then ``[DONE]`` where
    OpenAI's streams end with it (Anthropic's end at the error)."""
    end = b"\n\n" if endpoint is Endpoint.MESSAGES else b"\n\ndata: [DONE]\n\n"
    return error_event(endpoint, error) + end


def request_headers(request: ApiRequest) -> list[tuple[bytes, bytes]]:
    """Headers the replica's vLLM app gets: the request id, from which vLLM names the response and the
    engine request."""
    return [(b"x-request-id", request.request_id.encode())]


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


def with_engine_death_errors(data: bytes, replica_id: str, endpoint: Endpoint) -> bytes:
    """``data`` with each of vLLM's stream error events replaced by the one for a dead engine.

    vLLM ends a chat or completions stream whose engine died with an ``InternalServerError`` saying "EngineCore
    encountered an issue. See stack trace (above) for the root cause.", a trace no client has, and a Messages
    stream with a pydantic validation error of that event; the client gets what the ingress sends when a
    replica dies mid-stream instead: ``service_unavailable``, code ``engine_unavailable``.
    """
    event = error_event(endpoint, {"error": {
        "message": f"the model's engine died during the response (replica {replica_id}); retry the request",
        "type": "service_unavailable", "param": None, "code": "engine_unavailable"}})
    return b"\n\n".join(event if is_error_event(part) else part for part in data.split(b"\n\n"))


async def relay(events: AsyncIterator[AppStart | bytes], head: ResponseHead,
                strip_usage: bool = False) -> AsyncIterator[ReplicaChunk]:
    """The replica chunks of one response.

    The first chunk waits for the first body bytes, so an ingress that has it knows the replica started
    streaming (a replica that dies before then can be retried). A last chunk, marked final, carries the
    usage.

    Args:
        events: ``call_app``'s output.
        head: the replica's identity; status and media type are filled in from the app.
        strip_usage: drop a stream's usage event (the ingress asked for it; the client did not).
    """
    start = await anext(events)
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
