"""Errors in each API's shape: the error bodies and stream error events of OpenAI's and Anthropic's APIs, and
vLLM's stream error events told apart and replaced when its engine died."""

from __future__ import annotations

import json

from fleetserve.platform.api_types import Endpoint

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
