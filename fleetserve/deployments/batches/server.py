"""The batch service's Serve deployment: one replica, beside the ingress."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve

from fleetserve.deployments.batches.service import BatchService
from fleetserve.platform.config import BatchesConfig, ServerConfig
from fleetserve.platform.model_store import cache_root

BATCHES_DEPLOYMENT = "batches"


def front_door_url(server: ServerConfig) -> str:
    """Where the batch service reaches the platform's front door: this node's Serve proxy."""
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "localhost", "127.0.0.1") else server.host
    return f"http://{host}:{server.port}"


def batches_folder(config: BatchesConfig) -> Path:
    """The configured folder, or the model cache's ``batches`` folder on the service's node."""
    return Path(config.folder) if config.folder else cache_root() / "batches"


# One replica: the files and batches are its folder's, and a running batch is a task of its event loop.
# Its calls are short (a batch runs as a task of its own), so clients polling many batches need not queue.
@serve.deployment(name=BATCHES_DEPLOYMENT, num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class BatchDeployment(BatchService):
    """Ray Serve replica of the batch service; the ingress calls its ``call``."""

    def __init__(self, config: BatchesConfig, server: ServerConfig) -> None:
        super().__init__(batches_folder(config), front_door_url(server), config.max_concurrency)


class HandleBatches:
    """The batch service behind a Serve handle, with the plain service's ``call``."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def call(self, op: str, *args: Any) -> Any:
        return await self.handle.call.remote(op, *args)
