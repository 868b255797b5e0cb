"""Getting a replica's response to the client: engine failures as OpenAI errors, server-sent events that
always end their engine request, and the relay of a replica's stream (accounting its usage at the end).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi.responses import JSONResponse, StreamingResponse

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.deployments.serve_options import HEALTH_CHECK_PERIOD_S
from fleetserve.platform.api_types import Endpoint, ReplicaChunk, TokenUsage
from fleetserve.platform.engine import EngineDeadError, EngineRequestError
from fleetserve.platform.api_errors import anthropic_error, stream_error

logger = logging.getLogger(__name__)

# A replica whose engine died is noticed at Serve's next health check, which then starts its successor;
# a client retrying sooner finds the same replicas (the ingress has already tried every other one).
ENGINE_UNAVAILABLE_RETRY_AFTER_S = HEALTH_CHECK_PERIOD_S


def engine_unavailable(reason: str) -> APIError:
    """The 503 ``engine_unavailable`` for a request no replica's engine could take, with a Retry-After."""
    error = APIError(f"the model's engine is unavailable ({reason}); retry after {ENGINE_UNAVAILABLE_RETRY_AFTER_S} s",
                     503, "service_unavailable", code="engine_unavailable")
    error.headers = {"Retry-After": str(ENGINE_UNAVAILABLE_RETRY_AFTER_S)}
    return error


def as_api_error(error: BaseException) -> APIError:
    """Maps an exception from an engine (possibly wrapped by Ray) to the API error to return."""
    if isinstance(error, APIError):
        return error
    cause = getattr(error, "cause", None) or error
    if isinstance(error, EngineRequestError):
        cause = error
    if isinstance(cause, EngineRequestError):
        api_error = APIError(cause.message, cause.status_code, cause.error_type, cause.param, cause.code)
        if cause.retry_after_s is not None:
            api_error.headers = {"Retry-After": str(cause.retry_after_s)}
        return api_error
    if isinstance(cause, EngineDeadError):
        return engine_unavailable(str(cause))
    name = type(error).__name__
    if "ActorDied" in name or "ActorUnavailable" in name or "BackPressure" in name:
        return engine_unavailable(name)
    logger.exception("request failed in the engine", exc_info=error)
    return APIError(f"internal error in the engine: {name}: {cause}", 500, "internal_error")


def cut_off_error() -> APIError:
    """A replica's stream that ended before its final chunk: something between the engine and here broke
    off, so the error is the one a replica's death gives (and, before any chunk, the request is retried)."""
    return engine_unavailable("its replica's stream ended before the response did")


async def until_final(first: ReplicaChunk, stream: AsyncIterator[ReplicaChunk]) -> AsyncIterator[ReplicaChunk]:
    """The rest of a replica's response after ``first``.

    Raises:
        APIError: ``cut_off_error()``, when the stream ends without the replica's final chunk.
    """
    final = first.final
    try:
        async for chunk in stream:
            final = chunk.final
            yield chunk
    finally:
        await stream.aclose()  # closing the response early aborts the request in the engine
    if not final:
        raise cut_off_error()


def error_response(error: APIError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error as JSON: on Anthropic's paths in Anthropic's shape, as vLLM answers there; else OpenAI's."""
    endpoint = Endpoint.of_path(path)
    body = anthropic_error(error.body()) if endpoint is not None and endpoint.is_anthropic else error.body()
    return JSONResponse(body, status_code=error.status_code, headers={**(error.headers or {}), **(headers or {})})


class EventStreamResponse(StreamingResponse):
    """A server-sent-events response that always ends its body iterator, and so the engine request,
    when the stream stops for any reason.

    Starlette, under ASGI 2.4 servers, stops listening for the client's disconnect and leaves the body
    iterator unclosed when ``send`` fails; middleware can abandon it too. An unclosed iterator keeps its
    engine request running and its admission slot taken until garbage collection, if ever.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone
                        pass
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def relay_stream(endpoint: Endpoint, first: ReplicaChunk, stream: AsyncIterator[ReplicaChunk],
                       on_done: Callable[[TokenUsage | None], None]) -> AsyncIterator[bytes]:
    """The stream's bytes as the replica wrote them; a failure mid-stream ends it with the endpoint's error
    event (output cannot be unsent), and ``on_done`` gets the usage once the stream ends, however."""
    usage = first.usage
    try:
        if first.data:
            yield first.data
        async for chunk in stream:
            usage = chunk.usage or usage
            if chunk.data:
                yield chunk.data
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the client gets an error event, never silence
        yield stream_error(endpoint, as_api_error(error).body())
    finally:
        # A client that went away cancels this generator; closing the engine stream aborts the request.
        await stream.aclose()
        on_done(usage)
