"""Requests for a pool at zero replicas: held at the ingress, bounded, while the pool wakes.

The first held request goes on to Serve, whose queued request wakes the pool (the autoscaling policy
scales a pool with queued work from zero to one). The others wait here, in arrival order, until that
request's first token shows the pool is up; then they go on in the order they came. Past
``max_held_requests``, or ``hold_timeout_s`` after arriving, a request gets a 503 with a Retry-After of
the cold start's expected remainder. Plain asyncio (no Ray).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fleetserve.deployments.ingress.metrics import IngressMetrics
from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.config import AutoscalingConfig, ModelConfig

# The cold start a Retry-After assumes before one has been measured.
DEFAULT_COLD_START_S = 30.0


@dataclass
class _Wake:
    """One pool waking from zero."""

    # time.monotonic() when its first request was held.
    started_at: float
    # The held requests after the first, in arrival order, each waiting for its turn.
    waiters: deque[asyncio.Future[None]]


class ColdStartHold:
    """Holds requests for models whose serving pool is at zero replicas.

    Args:
        configs: model name -> config; only models whose serving pool has ``min_replicas: 0`` are held.
        metrics: the ingress's metrics (held requests, cold starts, refusals).
    """

    def __init__(self, configs: dict[str, ModelConfig], metrics: IngressMetrics) -> None:
        self.specs: dict[str, AutoscalingConfig] = {}
        for name, config in configs.items():
            autoscaling = config.serving_model().autoscaling
            if autoscaling is not None and autoscaling.min_replicas == 0:
                self.specs[name] = autoscaling
        self.platform_metrics = metrics
        self.num_held: dict[str, int] = {name: 0 for name in self.specs}
        # The last measured cold start per model: the first held request's wait for its first token.
        self.cold_start_s: dict[str, float] = {}
        self._wakes: dict[str, _Wake] = {}

    def scales_to_zero(self, model: str) -> bool:
        return model in self.specs

    def _retry_after(self, model: str, wake: _Wake | None) -> int:
        expected = self.cold_start_s.get(model, DEFAULT_COLD_START_S)
        elapsed = time.monotonic() - wake.started_at if wake is not None else 0.0
        return max(1, math.ceil(expected - elapsed))

    def refusal(self, model: str, message: str, code: str, wake: _Wake | None = None) -> APIError:
        """A 503 for a held request, with the expected rest of the cold start as its Retry-After."""
        retry = self._retry_after(model, wake)
        error = APIError(f"`{model}` is starting from zero replicas: {message}; retry after {retry} s", 503,
                         "service_unavailable", code=code)
        error.headers = {"Retry-After": str(retry)}
        self.platform_metrics.rejections.labels(model, code).inc()
        return error

    @asynccontextmanager
    async def held(self, model: str) -> AsyncIterator[float]:
        """Holds one request while ``model``'s pool is at zero; yields the seconds it may still wait for its
        first token. Leave the block once it has one (or has failed).

        Raises:
            APIError: 503 ``cold_start_full`` past max_held_requests, ``cold_start_timeout`` after
                hold_timeout_s, both with Retry-After.
        """
        spec = self.specs[model]
        wake = self._wakes.get(model)
        if self.num_held[model] >= spec.max_held_requests:
            raise self.refusal(model, f"{self.num_held[model]} requests already wait, the limit", "cold_start_full",
                                wake)
        arrived = time.monotonic()
        first = wake is None
        if first:
            wake = self._wakes[model] = _Wake(arrived, deque())
        self._change_held(model, +1)
        try:
            # A wake is dropped once its first request is answered, so a later one finds none and goes first.
            if not first:
                turn = asyncio.get_running_loop().create_future()
                wake.waiters.append(turn)
                try:
                    async with asyncio.timeout(spec.hold_timeout_s):
                        await turn
                except TimeoutError:
                    raise self.refusal(model, f"the pool did not wake within {spec.hold_timeout_s:g} s",
                                        "cold_start_timeout", wake) from None
                finally:
                    if turn in wake.waiters:
                        wake.waiters.remove(turn)
            yield max(0.0, spec.hold_timeout_s - (time.monotonic() - arrived))
            if first:
                self.cold_start_s[model] = time.monotonic() - arrived
                self.platform_metrics.cold_start.labels(model).observe(self.cold_start_s[model])
        finally:
            self._change_held(model, -1)
            if first:
                self._release(model, wake)

    def _release(self, model: str, wake: _Wake) -> None:
        """The first request has its answer (or failed): the others go on, in arrival order."""
        while wake.waiters:
            turn = wake.waiters.popleft()
            if not turn.done():
                turn.set_result(None)
        if self._wakes.get(model) is wake:
            del self._wakes[model]

    def _change_held(self, model: str, delta: int) -> None:
        self.num_held[model] += delta
        self.platform_metrics.held.labels(model).set(self.num_held[model])
