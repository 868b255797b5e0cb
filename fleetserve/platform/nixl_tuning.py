"""A vLLM general plugin that lets NIXL's progress thread sleep between polls.

NIXL's Python API starts each agent's progress thread with ``pthrDelay = 0``: it polls UCX without
pause and holds a whole core even while the engine is idle. On GPU hosts a core per engine may be
spare; on CPU hosts it is taken from the engines. Engines built with a ``KVTransferSpec`` set
``FLEETSERVE_NIXL_PROGRESS_DELAY_US``, and this plugin (loaded by vLLM in every engine process)
passes that delay to the agent. Processes without the variable are left untouched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)
DELAY_ENV = "FLEETSERVE_NIXL_PROGRESS_DELAY_US"


class _DelayedProgressBindings:
    """Stands in for NIXL's native bindings module; sets the delay on each agent's config."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's own name
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point."""
    delay = os.environ.get(DELAY_ENV)
    if not delay:
        return
    # vLLM sets this before its own first NIXL import (a UCX leak workaround); keep that behaviour.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return
    module_globals = nixl_agent.__init__.__globals__
    bindings = module_globals.get("nixlBind")
    if bindings is None or isinstance(bindings, _DelayedProgressBindings):
        return
    module_globals["nixlBind"] = _DelayedProgressBindings(bindings, int(delay))
    logger.debug("NIXL progress thread delay set to %s us in pid %d", delay, os.getpid())
