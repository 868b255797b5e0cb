"""Calls an ASGI app in-process for one request and streams its response as coalesced byte chunks.

An engine replica runs vLLM's own OpenAI app this way: no socket, no second HTTP parse, and every
feature of vLLM's server works as under ``vllm serve``. Closing the stream early tells the app the
client disconnected and cancels it, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

# Marks the end of the app's messages on the queue.
_DONE = object()
# How long an app whose caller left may take to stop the work it started before its task is cancelled.
DISCONNECT_GRACE_S = 2.0


@dataclass(frozen=True)
class AppStart:
    """The app's response status and content type."""

    status_code: int
    media_type: str


def _scope(path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        # Spec 2.3: Starlette's streaming responses then watch receive() for the disconnect we send on close.
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def call_app(app: Any, path: str, body: bytes,
                   headers: Sequence[tuple[bytes, bytes]] = ()) -> AsyncIterator[AppStart | bytes]:
    """Runs one POST through ``app``; yields its ``AppStart``, then body bytes.

    Each body item joins every message the app had sent by the time the consumer asked, so a consumer
    slower than the app gets fewer, larger items; the first item is never held back.

    Raises:
        Exception: whatever the app raised before its response was complete: before it started, or in the
            middle of a streamed body (an engine dying under vLLM's Responses stream), where ending quietly
            would pass a cut-off response for a whole one.
    """
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False
    # Whether the app sent its last body message (more_body false): the response is whole.
    finished = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal finished
        if disconnected.is_set():
            raise OSError("the caller closed the stream")
        finished = finished or (message.get("type") == "http.response.body" and not message.get("more_body"))
        queue.put_nowait(message)

    async def run() -> None:
        try:
            await app(_scope(path, body, headers), receive, send)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            # An app that raised after answering in full (Starlette sends its 500 first) has said what it had to.
            if not finished:
                queue.put_nowait(error)
            raise
        finally:
            queue.put_nowait(_DONE)

    task = asyncio.create_task(run())
    try:
        start = await _next_message(queue)
        if start is _DONE or start.get("type") != "http.response.start":
            raise RuntimeError("the app ended without a response")
        headers_out = {key.lower(): value for key, value in start.get("headers", [])}
        media_type = headers_out.get(b"content-type", b"application/json").decode("latin-1")
        yield AppStart(int(start["status"]), media_type)
        more = True
        held = None  # a message taken while coalescing that is not body: the next one to handle
        while more:
            message, held = held if held is not None else await queue.get(), None
            if isinstance(message, BaseException):
                raise message
            if message is _DONE:
                raise RuntimeError("the app ended its response before its last body message")
            parts, more = _body_of(message)
            while more and not queue.empty():
                message = queue.get_nowait()
                if message is _DONE or isinstance(message, BaseException):
                    held = message
                    break
                data, more = _body_of(message)
                parts += data
            if parts:
                yield bytes(parts)
    finally:
        disconnected.set()
        if not task.done():
            # vLLM's routes run their work in a task of their own, stopped when receive() says the client left
            # (with_cancellation); cancelling the route first would orphan that work, which would then run on
            # in the engine to max_tokens. So the app hears of the disconnect first.
            await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def _next_message(queue: asyncio.Queue) -> Any:
    message = await queue.get()
    if isinstance(message, BaseException):
        raise message
    return message


def _body_of(message: dict[str, Any]) -> tuple[bytearray, bool]:
    if message.get("type") != "http.response.body":
        return bytearray(), True
    return bytearray(message.get("body", b"")), bool(message.get("more_body", False))
