"""Adapters loaded on their first request: a base model's ``lora.adapter_root`` holds one adapter per subfolder,
served as ``<base>:<subfolder>`` (Ray Serve LLM's naming) once a request names it.

The load is the admin API's (vLLM's own load on one replica, then every replica of the base), so its checks and
errors are those of ``/v1/load_lora_adapter``; the requests that name an adapter while it loads wait on one load.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.config import ModelConfig

# A subfolder name: one path part, not hidden ("..", ".cache"), in the characters model names take.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class RootAdapter:
    """An adapter a request names under its base model's adapter root."""

    # The model name clients send: <base>:<folder>.
    name: str
    # The base model that serves it.
    base: str
    # Where it is loaded from: the root joined with the folder.
    path: str


def root_adapter(name: str, models: dict[str, ModelConfig]) -> RootAdapter | None:
    """The adapter ``name`` names under its base's ``lora.adapter_root``; None when it names none (no ``:``, no
    such model, or no adapter root on it).

    Raises:
        APIError: 400 when the part after ``:`` is no folder name (a path, or hidden).
    """
    base, colon, folder = name.partition(":")
    config = models.get(base)
    root = config.lora.adapter_root if config is not None and config.lora is not None else None
    if not colon or root is None:
        return None
    if not _FOLDER_NAME.fullmatch(folder):
        raise APIError(f"`{name}`: `{folder}` is no adapter folder name under the adapter root of `{base}` (letters, "
                       f"digits, `.`, `_` and `-`, not starting with `.`)", 400, param="model",
                       code="invalid_adapter_name")
    return RootAdapter(name, base, f"{root.rstrip('/')}/{folder}")


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


class RootAdapterLoads:
    """Loads adapters from adapter roots, one load per adapter at a time.

    Args:
        load: loads one adapter on every replica of its base; returns (HTTP status, body) as the admin API
            answers.
    """

    def __init__(self, load: Callable[[RootAdapter], Awaitable[tuple[int, bytes]]]) -> None:
        self._load_fn = load
        self._loading: dict[str, asyncio.Future[None]] = {}

    async def ensure(self, adapter: RootAdapter) -> None:
        """Returns once ``adapter`` is loaded, loading it unless a load of it is under way.

        Raises:
            APIError: 404 when the root has no such adapter; the admin API's status (400: vLLM refuses it)
                otherwise, with its reason.
        """
        loading = self._loading.get(adapter.name)
        if loading is None:
            loading = asyncio.ensure_future(self._load(adapter))
            self._loading[adapter.name] = loading
            loading.add_done_callback(lambda _: self._loading.pop(adapter.name, None))
        # A waiter that goes away (its client disconnected) leaves the load running for the others.
        await asyncio.shield(loading)

    async def _load(self, adapter: RootAdapter) -> None:
        status, body = await self._load_fn(adapter)
        if status == 200:
            return
        if status == 404:
            raise APIError(f"The model `{adapter.name}` does not exist: {_message(body)}", 404, "not_found_error",
                           param="model", code="model_not_found")
        raise APIError(f"The adapter `{adapter.name}` ({adapter.path}) cannot be served: {_message(body)}", status,
                       param="model", code="invalid_adapter")
