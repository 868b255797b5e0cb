"""The ingress's view of LoRA adapters: which base model serves each adapter name, and the admin API that
loads and unloads adapters on every replica of a base.

A change runs on one replica first, through vLLM's own load/unload (so its checks and errors are vLLM's),
then goes into the registry every replica converges on; the call returns once every live replica of the
base serves the new set, or says how many had caught up when ``wait_s`` ran out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.adapter_registry import AdapterOp, AdapterRegistry, AdapterSet
from fleetserve.platform.adapter_root import SEPARATOR

# How often the ingress re-reads the adapter names at most, when a request names an unknown model.
REFRESH_PERIOD_S = 1.0
# How often a change polls the replicas' progress.
PROGRESS_POLL_S = 0.2


class AdapterChange(BaseModel):
    """The body of /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's fields, plus the base model."""

    model_config = ConfigDict(extra="forbid")

    # The adapter's model name.
    lora_name: str
    # Where to load it from (load only): a PEFT folder on the replicas' machines or in object storage
    # (s3://, gs://, az://), or random-lora:<seed>.
    lora_path: str | None = None
    # Reload an already loaded adapter from lora_path (vLLM's semantics).
    load_inplace: bool = False
    # The base model that serves the adapter; needed only when more than one model has lora: configured.
    base_model: str | None = None


class AdapterCatalog(Protocol):
    """Where the adapter registry lives: in process (tests), or in the metrics hub (a Serve app)."""

    async def bases(self) -> dict[str, str]:
        """Every registered adapter's name -> its base model."""
        ...

    async def change(self, op: AdapterOp, base: str, name: str, source: str | None) -> int:
        """Records a change; returns the new set's version."""
        ...

    async def progress(self, base: str, version: int) -> tuple[int, int]:
        """(live replicas of ``base`` serving ``version``, live replicas of ``base``)."""
        ...


class LocalAdapterCatalog:
    """A registry in the ingress's process, over in-process engine servers (no Ray)."""

    def __init__(self, registry: AdapterRegistry, servers: dict[str, list[Any]]) -> None:
        self.registry = registry
        self.servers = servers

    async def bases(self) -> dict[str, str]:
        return self.registry.bases()

    async def change(self, op: AdapterOp, base: str, name: str, source: str | None) -> int:
        desired: AdapterSet = self.registry.apply(op, base, name, source)
        for server in self.servers.get(base, []):
            await server.sync_adapters(desired)
            self.registry.record_applied(server.replica_id, base, server.adapters.version)
        return desired.version

    async def progress(self, base: str, version: int) -> tuple[int, int]:
        return self.registry.progress(base, version, [s.replica_id for s in self.servers.get(base, [])])


class HubAdapterCatalog:
    """The registry the metrics hub holds, which every engine replica syncs with at each push."""

    def __init__(self, hub: Any) -> None:
        self.hub = hub

    async def bases(self) -> dict[str, str]:
        return await self.hub.adapter_bases.remote()

    async def change(self, op: AdapterOp, base: str, name: str, source: str | None) -> int:
        return await self.hub.change_adapters.remote(op, base, name, source)

    async def progress(self, base: str, version: int) -> tuple[int, int]:
        return await self.hub.adapter_progress.remote(base, version)


class AdapterDirectory:
    """Which base model serves each adapter name, as of the last read of the catalog.

    Args:
        configured: adapter name -> base model, from the platform config.
        lora_bases: the models with lora: configured (the only ones that can take adapters).
        catalog: where the registry lives; None serves the configured adapters only.
    """

    def __init__(self, configured: dict[str, str], lora_bases: list[str], catalog: AdapterCatalog | None) -> None:
        self.bases = dict(configured)
        self.lora_bases = lora_bases
        self.catalog = catalog
        self._read_at = 0.0

    def base_of(self, name: str) -> str | None:
        return self.bases.get(name)

    async def refresh(self, force: bool = False) -> None:
        """Re-reads the catalog, at most once per ``REFRESH_PERIOD_S`` unless forced."""
        if self.catalog is None or (not force and time.monotonic() - self._read_at < REFRESH_PERIOD_S):
            return
        self._read_at = time.monotonic()
        self.bases = await self.catalog.bases()

    def base_for_change(self, change: AdapterChange, op: AdapterOp, taken: set[str]) -> str:
        """The base model a change applies to.

        Raises:
            APIError: 400 for a name taken by a model or another base's adapter, or an ambiguous or
                unknown base; 404 unloading an adapter that is not loaded.
        """
        current = self.bases.get(change.lora_name)
        if op is AdapterOp.UNLOAD:
            if current is None:
                raise APIError(f"The lora adapter '{change.lora_name}' cannot be found.", 404, "NotFoundError",
                               param="lora_name", code="adapter_not_found")
            return current
        if change.lora_name in taken:
            raise APIError(f"`{change.lora_name}` is already a served or routed model name", 400,
                           param="lora_name", code="adapter_name_taken")
        if SEPARATOR in change.lora_name:
            raise APIError(f"`{change.lora_name}`: names with `{SEPARATOR}` are those of adapters under a base's "
                           f"lora.adapter_root, which load on their first request", 400, param="lora_name",
                           code="invalid_adapter_name")
        base = change.base_model or current or (self.lora_bases[0] if len(self.lora_bases) == 1 else None)
        if base is None:
            raise APIError(f"several models serve adapters ({', '.join(self.lora_bases)}); name one as base_model",
                           400, param="base_model", code="base_model_required")
        if base not in self.lora_bases:
            raise APIError(f"model `{base}` serves no LoRA adapters (no lora: in its config); models that do: "
                           f"{', '.join(self.lora_bases) or 'none'}", 400, param="base_model",
                           code="lora_not_enabled")
        if current is not None and current != base:
            raise APIError(f"adapter `{change.lora_name}` is already loaded under `{current}`", 400,
                           param="lora_name", code="adapter_name_taken")
        return base

    async def wait_for(self, base: str, version: int, wait_s: float) -> tuple[int, int]:
        """Waits until every live replica of ``base`` serves ``version``, or ``wait_s`` passes.

        Returns:
            (replicas serving it, live replicas) when it returned.
        """
        deadline = time.monotonic() + wait_s
        while True:
            done, live = await self.catalog.progress(base, version)
            if done >= live or time.monotonic() >= deadline:
                return done, live
            await asyncio.sleep(PROGRESS_POLL_S)
