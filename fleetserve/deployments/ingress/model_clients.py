"""How the ingress reaches a model's engines: a ``ModelClient`` per served model.

``HandleModelClient`` goes through the model's Serve deployment handle (Serve's request router, ours or
its default, picks the replica); ``LocalModelClient`` calls an ``EngineServer`` in process (tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.platform.api_types import ApiRequest, ReplicaChunk
from fleetserve.router.replica import decisions


class ModelClient(Protocol):
    """How the ingress reaches one model's engines."""

    def forward(self, request: ApiRequest) -> AsyncIterator[ReplicaChunk]: ...

    def route_reason(self, request_id: str) -> str | None:
        """Why the replica router chose the replica for this request, when a router decided."""
        ...


class LocalModelClient:
    """Calls an in-process ``EngineServer`` (tests, single-process use)."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def forward(self, request: ApiRequest) -> AsyncIterator[ReplicaChunk]:
        return self.server.forward(request)

    def route_reason(self, request_id: str) -> str | None:
        return None


class HandleModelClient:
    """Calls an engine deployment through a Serve handle, cancelling it if the stream is dropped."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle.options(stream=True)

    async def forward(self, request: ApiRequest) -> AsyncIterator[ReplicaChunk]:
        response = self.handle.forward.remote(request)
        done = False
        try:
            async for chunk in response:
                yield chunk
            done = True
        finally:
            if not done:
                response.cancel()

    def route_reason(self, request_id: str) -> str | None:
        decision = decisions.pop(request_id)
        return decision.reason if decision is not None else None
