"""One engine replica's LoRA adapters, changed through vLLM's own serving-models object (the one behind
``vllm serve``'s /v1/load_lora_adapter), so loading and unloading keep vLLM's semantics and errors."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from fleetserve.platform.adapter_registry import AdapterOp, AdapterSet
from fleetserve.platform.lora_store import AdapterSourceError, resolve_adapter_source

logger = logging.getLogger(__name__)


def _error_body(message: str, status: int, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": "lora_path", "code": status}}).encode()


class ReplicaAdapters:
    """Loads and unloads adapters in one replica's vLLM app, and converges on the registry's set.

    Args:
        base_path: the base model's folder, which random adapters are built for.
        max_lora_rank: the engine's largest adapter rank (the model's ``lora.max_lora_rank``).
    """

    def __init__(self, base_path: Path, max_lora_rank: int) -> None:
        self.base_path = base_path
        self.max_lora_rank = max_lora_rank
        # The registry version this replica serves; 0 is the configured set vLLM loads at start.
        self.version = 0
        # adapter name -> the source it was loaded from
        self._sources: dict[str, str] = {}
        # Adapters from the model's adapter root, loaded here by their first request: no registry holds them.
        self._root_names: set[str] = set()
        self._root_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def change(self, app: Any, op: AdapterOp, name: str, source: str | None = None,
                     load_inplace: bool = False) -> tuple[int, bytes]:
        """Loads (from ``source``) or unloads one adapter, as vLLM's admin endpoints do.

        Returns:
            vLLM's status code and body: its success text, or its error JSON.
        """
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        models = app.state.openai_serving_models
        if op is AdapterOp.LOAD:
            try:
                path = resolve_adapter_source(source or "", self.base_path, self.max_lora_rank)
            except AdapterSourceError as error:
                kind = "NotFoundError" if error.status_code == 404 else "BadRequestError"
                return error.status_code, _error_body(str(error), error.status_code, kind)
            result = await models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path), load_inplace=load_inplace),
                base_model_name=models.base_model_paths[0].name)
        else:
            result = await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        if isinstance(result, ErrorResponse):
            return result.error.code, result.model_dump_json().encode()
        if op is AdapterOp.LOAD:
            self._sources[name] = source or ""
        else:
            self._sources.pop(name, None)
            self._root_names.discard(name)
        return 200, result.encode()

    async def ensure(self, app: Any, name: str, source: str) -> tuple[int, bytes]:
        """Loads the adapter-root adapter ``name`` from ``source`` unless this replica serves it already; requests
        naming it meanwhile wait on that one load.

        Returns:
            200 when it is served; else the failed load's status and body.
        """
        async with self._root_locks[name]:
            if name in app.state.openai_serving_models.lora_requests:
                return 200, b""
            status, body = await self.change(app, AdapterOp.LOAD, name, source)
            if status == 200:
                self._root_names.add(name)
            return status, body

    async def sync(self, app: Any, desired: AdapterSet) -> None:
        """Loads and unloads until this replica serves exactly ``desired``; a failure is logged and left for
        the next sync (the version stays behind, so the admin API sees this replica has not caught up)."""
        models = app.state.openai_serving_models
        served = set(models.lora_requests)
        ok = True
        for name in sorted(served - set(desired.sources) - self._root_names):
            ok &= (await self.change(app, AdapterOp.UNLOAD, name))[0] == 200
        for name, source in sorted(desired.sources.items()):
            if name in served and self._sources.get(name, source) == source:
                continue
            status, body = await self.change(app, AdapterOp.LOAD, name, source, load_inplace=name in served)
            if status != 200:
                logger.warning("adapter %s from %s failed to load: %s", name, source, body[:300])
                ok = False
        if ok:
            self.version = desired.version

    @staticmethod
    async def resident(app: Any, engine: Any) -> list[str]:
        """The served adapters whose weights the engine holds now (its LoRA cache), by name."""
        models = app.state.openai_serving_models
        ids = await engine.resident_lora_ids()
        return sorted(request.lora_name for request in models.lora_requests.values() if request.lora_int_id in ids)
