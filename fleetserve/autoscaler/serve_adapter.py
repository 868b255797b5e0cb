"""Ray Serve adapter: fleetserve's policies as a Serve custom autoscaling policy. The one Ray-aware file here.

Serve instantiates ``ServeAutoscalingPolicy`` once per deployment (with ``policy_kwargs``) in its
controller and calls it every control loop with an ``AutoscalingContext``; replicas feed it through
``record_autoscaling_stats()``, each a ``ReplicaReport`` as Serve's named float metrics (``autoscaling_metrics``),
which Serve aggregates per replica and this adapter reads back as reports. The policy decides once per
``decision_period_s`` and repeats its last answer in between. Decisions are logged when they change,
and exported as ``fleetserve_autoscaler_desired_replicas`` and ``fleetserve_autoscaler_decisions_total``
through a small named actor that the metrics hub reads.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import ray

from fleetserve.autoscaler.pd_ratio import PEER, within_ratio
from fleetserve.autoscaler.policies import make_policy
from fleetserve.autoscaler.policy import Decision, PoolObservation
from fleetserve.platform.config import AutoscalingConfig, PDRatio
from fleetserve.platform.output_lengths import NUM_OUTPUT_LENGTH_BUCKETS
from fleetserve.platform.replica_report import ReplicaReport

logger = logging.getLogger("ray.serve")
METRICS_ACTOR = "fleetserve-autoscaler-metrics"
METRICS_NAMESPACE = "fleetserve"
# The report's fields that travel as Serve's custom autoscaling metrics (floats by name), and those that are counts.
METRIC_FIELDS = ("kv_cache_usage", "num_waiting", "num_running", "tokens_per_s", "generated_tokens_per_s",
                 "prompt_tokens_per_s", "first_tokens_per_s", "num_pending_prompt_tokens", "ttft_s")
COUNT_FIELDS = frozenset({"num_waiting", "num_running", "num_pending_prompt_tokens"})
# The finished-request rates by output length travel as one float per bucket, named by its index.
LENGTH_METRIC = "finished_per_s_by_length_{}"
LENGTH_METRICS = tuple(LENGTH_METRIC.format(index) for index in range(NUM_OUTPUT_LENGTH_BUCKETS))
# Each pool's latest desired count by (application, model, pool): Serve runs every deployment's policy in
# its one controller process, so a disaggregated model's two pools read each other's here (pd_ratio).
_POOL_TARGETS: dict[tuple[str, str, str], int] = {}


@ray.remote(num_cpus=0)
class AutoscalerMetrics:
    """Holds the autoscaler's Prometheus metrics (the controller process exposes none of ours)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.desired = Gauge("fleetserve_autoscaler_desired_replicas", "Replicas the autoscaling policy wants.",
                             ["model", "pool"], registry=self.registry)
        self.decisions = Counter("fleetserve_autoscaler_decisions", "Autoscaling decisions by reason.",
                                 ["model", "pool", "reason"], registry=self.registry)

    def record(self, model: str, pool: str, desired: int, reason: str) -> None:
        self.desired.labels(model, pool).set(desired)
        self.decisions.labels(model, pool, reason).inc()

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def autoscaler_exposition(timeout_s: float = 2.0) -> bytes:
    """The autoscaler's metrics, or nothing when none of fleetserve's policies is running."""
    try:
        actor = ray.get_actor(METRICS_ACTOR, namespace=METRICS_NAMESPACE)
        return ray.get(actor.exposition.remote(), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayError):
        return b""


def autoscaling_metrics(report: ReplicaReport) -> dict[str, float]:
    """A replica's report as Serve's custom autoscaling metrics (``record_autoscaling_stats``); no TTFT
    when no request got a first token since the previous report."""
    metrics = {name: float(getattr(report, name)) for name in METRIC_FIELDS if getattr(report, name) is not None}
    metrics.update(zip(LENGTH_METRICS, map(float, report.finished_per_s_by_length)))
    return metrics


def _reports(metrics: dict[str, dict[Any, float]], replica_ids: list[Any], pool: str) -> tuple[ReplicaReport, ...]:
    """The running replicas' reports from Serve's per-replica aggregates; replicas without any yet are starting."""
    reports = []
    for replica_id in replica_ids:
        values = {name: metrics.get(name, {}).get(replica_id) for name in METRIC_FIELDS}
        if values["kv_cache_usage"] is None:
            continue
        fields: dict[str, Any] = {name: (int(round(value)) if name in COUNT_FIELDS else float(value))
                                  for name, value in values.items() if value is not None and not math.isnan(value)}
        lengths = [metrics.get(name, {}).get(replica_id) for name in LENGTH_METRICS]
        if all(value is not None and not math.isnan(value) for value in lengths):
            fields["finished_per_s_by_length"] = tuple(map(float, lengths))
        reports.append(ReplicaReport(replica_id=getattr(replica_id, "unique_id", str(replica_id)), pool=pool,
                                     **fields))
    return tuple(reports)


class ServeAutoscalingPolicy:
    """Serve's class-callable custom policy around a ``fleetserve.autoscaler.policy`` policy.

    Args:
        model: the model's name (metrics and logs).
        autoscaling: the pool's ``AutoscalingConfig`` as a dict (Serve's policy_kwargs must be JSON).
        pd_ratio: a disaggregated model's ``pd_ratio`` as a dict: this pool is kept within it of the other.
    """

    def __init__(self, model: str = "", autoscaling: dict[str, Any] | None = None,
                 pd_ratio: dict[str, Any] | None = None) -> None:
        self.model = model
        self.config = AutoscalingConfig.model_validate(autoscaling or {})
        self.pd_ratio = PDRatio.model_validate(pd_ratio) if pd_ratio is not None else None
        self.decision_period_s = self.config.decision_period_s
        self.policy = make_policy(self.config)
        self.last: tuple[float, int, str] | None = None
        self._metrics: Any = None

    def _metrics_actor(self) -> Any:
        if self._metrics is None:
            self._metrics = AutoscalerMetrics.options(name=METRICS_ACTOR, namespace=METRICS_NAMESPACE,
                                                      get_if_exists=True).remote()
        return self._metrics

    def _within_ratio(self, ctx: Any, decision: Decision) -> Decision:
        """The decision kept within pd_ratio of the other pool's latest count, which this one then reads."""
        if self.pd_ratio is None or self.config.pool not in PEER:
            return decision
        app = getattr(ctx, "app_name", None) or ""
        peer = _POOL_TARGETS.get((app, self.model, PEER[self.config.pool]))
        decision = within_ratio(decision, self.config.pool, peer, self.pd_ratio, self.config)
        _POOL_TARGETS[(app, self.model, self.config.pool)] = decision.desired_replicas
        return decision

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time or time.time()
        if self.last is not None and now - self.last[0] < self.decision_period_s:
            return self.last[1], ctx.policy_state
        reports = _reports(ctx.aggregated_metrics or {}, list(ctx.running_replicas), self.config.pool)
        queued = ctx.total_queued_requests or 0.0
        observation = PoolObservation(now, ctx.target_num_replicas, reports, int(round(queued)))
        decision = self._within_ratio(ctx, self.policy.decide(observation))
        if self.last is None or (decision.desired_replicas, decision.reason) != self.last[1:]:
            logger.info("autoscaler %s/%s: %d -> %d replicas (%s: %s)", self.model, self.config.pool,
                        ctx.target_num_replicas, decision.desired_replicas, decision.reason, decision.detail)
        self.last = (now, decision.desired_replicas, decision.reason)
        try:
            self._metrics_actor().record.remote(self.model, self.config.pool, decision.desired_replicas,
                                                decision.reason)
        except Exception:  # noqa: BLE001 - metrics must never stop scaling
            logger.warning("autoscaler metrics actor unavailable", exc_info=True)
        state = {**(ctx.policy_state or {}), "reason": decision.reason, "detail": decision.detail}
        return decision.desired_replicas, state
