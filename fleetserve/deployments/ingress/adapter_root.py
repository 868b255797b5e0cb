"""The ingress's view of adapter roots: which base model serves a ``<base>:<folder>`` name.

The ingress loads nothing: the request goes to a replica of the base, which loads the adapter the first time it
serves it (``EngineServer``), and the replica router prefers replicas that hold it, as for any adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.adapter_root import SEPARATOR, AdapterNameError, holds_adapter, list_folders, root_folder
from fleetserve.platform.config import ModelConfig

logger = logging.getLogger(__name__)
# How long one listing of the adapter roots serves /v1/models: a listing of object storage costs a request per
# root, and an adapter added to a root is served on its first request whether or not it is listed yet.
ROOT_LIST_TTL_S = 30.0


def root_base(name: str, models: dict[str, ModelConfig]) -> str | None:
    """The base model whose adapter root ``name`` names a folder of; None when it names none (no ``:``, no such
    model, or no adapter root on it).

    Raises:
        APIError: 400 when the part after ``:`` is no folder name (a path, or hidden).
    """
    base = name.partition(SEPARATOR)[0]
    config = models.get(base)
    if config is None or config.lora is None or config.lora.adapter_root is None:
        return None
    try:
        return base if root_folder(name, base) is not None else None
    except AdapterNameError as error:
        raise APIError(str(error), 400, param="model", code="invalid_adapter_name") from None


class RootListing:
    """The adapters under the models' adapter roots, as /v1/models lists them: read where the ingress runs (object
    storage, or a folder this node shares with the replicas'), at most once per ``ttl_s``.

    Args:
        models: model name -> config; those with ``lora.adapter_root`` are listed.
        ttl_s: how long one listing serves.
        clock: seconds, monotonic.
    """

    def __init__(self, models: dict[str, ModelConfig], ttl_s: float = ROOT_LIST_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.roots = {name: config.lora.adapter_root for name, config in models.items()
                      if config.lora is not None and config.lora.adapter_root is not None}
        self.ttl_s = ttl_s
        self.clock = clock
        # Adapter name -> its base, as last listed; kept through a listing that fails.
        self.bases: dict[str, str] = {}
        self._listed_at: float | None = None
        self._lock = asyncio.Lock()

    async def refresh(self) -> dict[str, str]:
        """Adapter name -> base model, listed afresh when the last listing is older than ``ttl_s``."""
        async with self._lock:
            now = self.clock()
            if self.roots and (self._listed_at is None or now - self._listed_at >= self.ttl_s):
                self._listed_at = now
                self.bases = await asyncio.to_thread(self._list)
        return self.bases

    async def find(self, name: str) -> bool:
        """Whether ``name`` is an adapter of a root: listed, or a folder added since the last listing (checked in
        the store itself, and then listed until the next listing). A name that is no folder name is none.
        """
        if name in self.bases:
            return True
        base = name.partition(SEPARATOR)[0]
        try:
            folder = root_folder(name, base) if base in self.roots else None
        except AdapterNameError:
            return False
        if folder is None:
            return False
        try:
            found = await asyncio.to_thread(holds_adapter, self.roots[base], folder)
        except ValueError as error:  # ObjectStoreError
            logger.warning("cannot read the adapter root of %s: %s", base, error)
            return False
        if found:
            self.bases = {**self.bases, name: base}
        return found

    def _list(self) -> dict[str, str]:
        bases = {}
        for base, root in sorted(self.roots.items()):
            try:
                folders = list_folders(root)
            except ValueError as error:  # ObjectStoreError: keep what this root listed last
                logger.warning("cannot list the adapter root of %s: %s", base, error)
                folders = [name.partition(SEPARATOR)[2] for name, was in self.bases.items() if was == base]
            bases.update({f"{base}{SEPARATOR}{folder}": base for folder in folders})
        return bases
