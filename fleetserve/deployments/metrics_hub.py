"""Collects each engine replica's metrics exposition so the ingress can serve one ``/metrics``.

Ray's own metrics export renames every metric (``ray_`` prefix), which would break vLLM's names;
so replicas publish their own prometheus-client expositions here instead, about once a second.
The hub also holds the LoRA adapter registry: each push answers with the set of adapters the
replica's base model should serve, so replicas converge on it within a push period.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ray import serve

from fleetserve.platform.adapter_registry import AdapterOp, AdapterRegistry, AdapterSet
from fleetserve.platform.replica_report import ReplicaReport


# A replica silent this long is gone (dead or scaled down): its series, report and adapter progress drop.
REPLICA_TTL_S = 15.0


@dataclass(frozen=True)
class Publication:
    """What one replica last published."""

    model: str
    # colocated, prefill or decode.
    pool: str
    # time.monotonic() when it arrived; a replica silent for the hub's ttl_s is gone.
    pushed_at: float
    # The replica's metrics in Prometheus text format.
    exposition: bytes


class MetricsHub:
    """The latest exposition of every live engine replica.

    Args:
        adapters: base model -> adapter name -> source, the configured LoRA adapters.
        ttl_s: a replica silent this long is gone (dead or scaled down) and its series are dropped.
    """

    def __init__(self, adapters: dict[str, dict[str, str]] | None = None, ttl_s: float = REPLICA_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.adapters = AdapterRegistry(adapters)
        self._latest: dict[str, Publication] = {}
        # replica id -> its report at its last push (admission control reads them)
        self._reports: dict[str, ReplicaReport] = {}

    def _prune(self) -> None:
        horizon = time.monotonic() - self.ttl_s
        gone = [key for key, entry in self._latest.items() if entry.pushed_at < horizon]
        for replica_id in gone:
            del self._latest[replica_id]
            self._reports.pop(replica_id, None)
        self.adapters.forget(gone)

    async def push(self, replica_id: str, model: str, pool: str, exposition: bytes,
                   report: ReplicaReport | None = None, adapters_version: int | None = None) -> AdapterSet:
        """Takes a replica's metrics and report; answers with the adapter set its base model should serve.

        Args:
            adapters_version: the adapter set version the replica serves; None before it has synced.
        """
        self._latest[replica_id] = Publication(model, pool, time.monotonic(), exposition)
        if report is not None:
            self._reports[replica_id] = report
        if adapters_version is not None:
            self.adapters.record_applied(replica_id, model, adapters_version)
        return self.adapters.desired(model)

    async def remove(self, replica_id: str) -> None:
        self._latest.pop(replica_id, None)
        self._reports.pop(replica_id, None)
        self.adapters.forget([replica_id])

    async def adapter_set(self, model: str) -> AdapterSet:
        """The adapters every replica of ``model`` should serve."""
        return self.adapters.desired(model)

    async def adapter_bases(self) -> dict[str, str]:
        """Every registered adapter's name -> its base model."""
        return self.adapters.bases()

    async def change_adapters(self, op: AdapterOp, model: str, name: str, source: str | None = None) -> int:
        """Loads or unloads one adapter of ``model`` in the registry; returns the new set's version."""
        return self.adapters.apply(op, model, name, source).version

    async def configure_adapters(self, configured: dict[str, dict[str, str]]) -> dict[str, int]:
        """Takes a new platform config's adapters (AdapterRegistry.reconcile); returns the changed bases'
        versions, which replicas then converge on at their next push."""
        return self.adapters.reconcile(configured)

    async def adapter_progress(self, model: str, version: int) -> tuple[int, int]:
        """(live replicas of ``model`` serving ``version`` or later, live replicas of ``model``)."""
        self._prune()
        live = [replica_id for replica_id, entry in self._latest.items() if entry.model == model]
        return self.adapters.progress(model, version, live)

    async def loads(self) -> dict[str, list[ReplicaReport]]:
        """Every live replica's latest report, per model."""
        self._prune()
        loads: dict[str, list[ReplicaReport]] = {}
        for replica_id, report in self._reports.items():
            loads.setdefault(self._latest[replica_id].model, []).append(report)
        return loads

    async def collect(self) -> tuple[list[bytes], dict[tuple[str, str], int]]:
        """Every live replica's exposition, and the number of live replicas per (model, pool)."""
        self._prune()
        counts = Counter((entry.model, entry.pool) for entry in self._latest.values())
        return [entry.exposition for entry in self._latest.values()], dict(counts)


# The hub's Serve deployment name, for handles to it (fleetserve apply waits on its adapter registry).
HUB_DEPLOYMENT = "metrics-hub"


@serve.deployment(name=HUB_DEPLOYMENT, num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # a push per replica per second
class MetricsHubDeployment(MetricsHub):
    """Ray Serve replica of the hub; one per application. Also relays the autoscaler's metrics, which
    live in the Serve controller's policy objects."""

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's in-place update: a config that changes only adapters keeps this replica, and the registry
        with the adapters loaded through the admin API."""
        await self.configure_adapters(user_config["adapters"])

    async def collect(self) -> tuple[list[bytes], dict[tuple[str, str], int]]:
        import asyncio

        from fleetserve.autoscaler.serve_adapter import autoscaler_exposition

        texts, counts = await super().collect()
        autoscaler = await asyncio.get_running_loop().run_in_executor(None, autoscaler_exposition)
        return ([*texts, autoscaler] if autoscaler else texts), counts
