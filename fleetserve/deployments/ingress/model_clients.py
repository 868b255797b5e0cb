"""How the ingress reaches a model's engines: a ``ModelClient`` per served model.

``HandleModelClient`` goes through the model's Serve deployment handle (Serve's request router, ours or
its default, picks the replica); ``LocalModelClient`` calls an ``EngineServer`` in process (tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.serve_options import data_path_handle_options
from fleetserve.platform.adapter_registry import AdapterOp
from fleetserve.platform.api_types import ApiRequest, ReplicaChunk
from fleetserve.router.replica import decisions


class ModelClient(Protocol):
    """How the ingress reaches one model's engines."""

    def forward(self, request: ApiRequest) -> AsyncIterator[ReplicaChunk]: ...

    def route_reason(self, request_id: str) -> str | None:
        """Why the replica router chose the replica for this request, when a router decided."""
        ...

    async def change_adapter(self, op: AdapterOp, name: str, source: str | None,
                             load_inplace: bool) -> tuple[int, bytes]:
        """Loads or unloads a LoRA adapter on one replica (vLLM's status code and body)."""
        ...


class LocalModelClient:
    """Calls an in-process ``EngineServer`` (tests, single-process use)."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def forward(self, request: ApiRequest) -> AsyncIterator[ReplicaChunk]:
        return self.server.forward(request)

    def route_reason(self, request_id: str) -> str | None:
        return None

    async def change_adapter(self, op: AdapterOp, name: str, source: str | None,
                             load_inplace: bool) -> tuple[int, bytes]:
        return await self.server.change_adapter(op, name, source, load_inplace)


class HandleModelClient:
    """Calls an engine deployment through a Serve handle, cancelling it if the stream is dropped."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle.options(stream=True, **data_path_handle_options())
        self._unary = handle.options(stream=False)

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

    async def change_adapter(self, op: AdapterOp, name: str, source: str | None,
                             load_inplace: bool) -> tuple[int, bytes]:
        return await self._unary.change_adapter.remote(op, name, source, load_inplace)

    def route_reason(self, request_id: str) -> str | None:
        decision = decisions.pop(request_id)
        return decision.reason if decision is not None else None
