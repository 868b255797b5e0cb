"""call_app: an in-process app's response as byte chunks; a response cut off by an error is never passed
on as a whole one."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request

from fleetserve.platform.asgi_call import AppStart, call_app


def streaming_app(num_chunks: int, then: BaseException | None = None, finish: bool = True, pause: bool = True):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for index in range(num_chunks):
            await send({"type": "http.response.body", "body": f"c{index};".encode(), "more_body": True})
            if pause:
                await asyncio.sleep(0)
        if then is not None:
            raise then
        if finish:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def collect(app) -> tuple[list, BaseException | None]:
    items: list = []
    try:
        async for item in call_app(app, "/v1/x", b"{}"):
            items.append(item)
    except Exception as error:  # noqa: BLE001
        return items, error
    return items, None


def test_a_whole_stream_arrives_without_error():
    items, error = asyncio.run(collect(streaming_app(3)))
    assert error is None and items[0] == AppStart(200, "text/plain") and b"".join(items[1:]) == b"c0;c1;c2;"


@pytest.mark.parametrize("pause", [True, False], ids=["one-by-one", "coalesced"])
def test_an_app_raising_mid_stream_raises_after_what_it_sent(pause):
    # Without a pause, the body messages and the error are all queued before the consumer reads them: the
    # error, taken while coalescing, must still come after the body.
    items, error = asyncio.run(collect(streaming_app(2, then=RuntimeError("engine died"), pause=pause)))
    assert b"".join(items[1:]) == b"c0;c1;" and str(error) == "engine died"


def test_an_app_ending_without_its_last_body_message_raises():
    items, error = asyncio.run(collect(streaming_app(1, finish=False)))
    assert b"".join(items[1:]) == b"c0;" and "before its last body message" in str(error)


def test_an_app_raising_after_a_whole_response_has_said_what_it_had_to():
    async def app(scope, receive, send):  # as Starlette's ServerErrorMiddleware: its 500, then the re-raise
        await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Internal Server Error", "more_body": False})
        raise ValueError("bug")

    items, error = asyncio.run(collect(app))
    assert error is None and items == [AppStart(500, "text/plain"), b"Internal Server Error"]


def test_an_app_raising_before_it_answers_raises():
    async def app(scope, receive, send):
        raise ValueError("no route")

    items, error = asyncio.run(collect(app))
    assert items == [] and str(error) == "no route"


def test_a_caller_leaving_before_the_answer_stops_work_an_app_handler_started():
    # vLLM's routes run their work in a task of their own (with_cancellation), stopped when the request's
    # receive() says the client left; cancelling the route first would leave that work running in the engine
    # to max_tokens, as a non-streamed request's did when its caller timed out.
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    app = FastAPI()
    work: list[str] = []

    @app.post("/v1/x")
    @with_cancellation
    async def answer(raw_request: Request):
        work.append("started")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            work.append("cancelled")
            raise
        return {"done": True}

    async def leave_early() -> None:
        consumer = asyncio.ensure_future(anext(call_app(app, "/v1/x", b"{}")))
        while not work:
            await asyncio.sleep(0.01)
        consumer.cancel()  # as Serve cancels a replica's call whose caller left
        with pytest.raises(asyncio.CancelledError):
            await consumer
        # Stopped by the time the call has ended, not left to the event loop's shutdown.
        assert work == ["started", "cancelled"]

    asyncio.run(asyncio.wait_for(leave_early(), 10))
