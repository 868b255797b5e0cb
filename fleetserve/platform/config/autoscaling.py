"""A pool's autoscaling (a model's, or one pool's, ``autoscaling:``): the one schema the platform serves and
``fleetserve autoscale simulate`` replays, so a simulated policy pastes into the platform unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from fleetserve.platform.config.base import Strict

AutoscalingPolicyName = Literal["kv_cache", "ray_default", "queue_depth", "slo"]

# Knobs every policy reads (the hold knobs are the ingress's, for a pool that scales to zero).
COMMON_KNOBS = frozenset({"policy", "min_replicas", "max_replicas", "pool", "metrics_interval_s",
                          "max_held_requests", "hold_timeout_s"})
# Knobs that only act on a pool that can scale to zero.
ZERO_KNOBS = ("max_held_requests", "hold_timeout_s", "idle_to_zero_s")
# The knobs each policy reads besides the common ones; setting another policy's knob is an error, since
# it would silently do nothing.
POLICY_KNOBS: dict[str, frozenset[str]] = {
    "kv_cache": frozenset({"target_high", "target_low", "prefill_tokens_per_s", "target_prefill_high",
                           "target_prefill_low", "max_waiting_per_replica", "ttft_target_s", "window_s",
                           "kv_lookahead_s", "scale_down_cooldown_s", "idle_to_zero_s", "max_step_up", "max_step_down",
                           "upscale_stabilization_s", "downscale_stabilization_s", "decision_period_s"}),
    # Ray Serve's own policy: Serve applies no step limits or stabilization windows of ours.
    "ray_default": frozenset({"target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"}),
    "queue_depth": frozenset({"target_queue_per_replica", "max_step_up", "max_step_down", "upscale_stabilization_s",
                              "downscale_stabilization_s", "decision_period_s"}),
    # Derives its thresholds from the SLOs and the profile; the kv_cache knobs it shares are overrides.
    "slo": frozenset({"ttft_p99_s", "tpot_p99_s", "profile", "window_s", "decision_period_s", "target_high",
                      "target_prefill_high", "scale_down_cooldown_s", "idle_to_zero_s"}),
}


class ReplicaProfile(Strict):
    """What one replica of a model does on its hardware: measured by ``benchmarks/autoscaling.py
    calibrate``, or derived for a GPU shape. The simulator replays it; the ``slo`` policy sizes pools on it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # KV-cache capacity in tokens (KV bytes / KV bytes per token).
    kv_capacity_tokens: int = Field(default=16384, gt=0)
    # Prompt tokens prefilled per second when prefill has the engine to itself.
    prefill_tokens_per_s: float = Field(default=4000.0, gt=0)
    # One decode step takes decode_step_base_s + decode_step_per_seq_s * batch
    # + decode_step_per_kv_token_s * (KV tokens the batch's sequences hold): decode reads every running
    # sequence's whole KV each step, so long contexts slow it (memory bandwidth, not compute).
    decode_step_base_s: float = Field(default=0.010, gt=0)
    decode_step_per_seq_s: float = Field(default=0.001, ge=0)
    decode_step_per_kv_token_s: float = Field(default=0.0, ge=0)
    # Most sequences running at once (max_num_seqs) and tokens per step (max_num_batched_tokens).
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    # Seconds from "add a replica" to serving (process start, weight load, warm-up).
    startup_s: float = Field(default=30.0, ge=0)
    # Fixed latency each request's first token carries beyond engine steps (API, IPC, scheduling).
    request_overhead_s: float = Field(default=0.0, ge=0)


class AutoscalingConfig(Strict):
    """Replica autoscaling for one pool (replaces a fixed replica count).

    ``kv_cache`` is fleetserve's policy (``fleetserve.autoscaler.policy.KVCachePolicy``): it scales on KV
    usage, prefill work, queued requests and TTFT. ``slo`` (``fleetserve.autoscaler.slo_policy.SLOPolicy``)
    derives its thresholds from p99 TTFT and TPOT targets and a replica profile, and sizes the pool for
    the demand it forecasts one start-up ahead. ``ray_default`` is Ray Serve's ongoing-requests policy
    (served by Serve itself). ``queue_depth`` is a KEDA-style queue-length scaler, for comparison.
    """

    policy: AutoscalingPolicyName = "kv_cache"
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    # Which signals apply (decode: KV and queue; prefill: prefill work, queue and TTFT; colocated: all).
    # A disaggregated model's pools get their own phase.
    pool: Literal["colocated", "prefill", "decode"] = "colocated"
    # kv_cache: up above this mean KV usage; down only after it stays below target_low for the cooldown.
    target_high: float = Field(default=0.75, gt=0, le=1)
    target_low: float = Field(default=0.35, ge=0, lt=1)
    # kv_cache: one replica's prefill throughput in prompt tokens/s (measure it with
    # benchmarks/autoscaling.py calibrate); None leaves prefill load to the queue and TTFT rules.
    prefill_tokens_per_s: float | None = Field(default=None, gt=0)
    # kv_cache: prefill and colocated pools grow when prompt-token demand exceeds this share of the pool's
    # prefill throughput, and may shrink once it falls below target_prefill_low.
    target_prefill_high: float = Field(default=0.6, gt=0, le=1)
    target_prefill_low: float = Field(default=0.3, ge=0, lt=1)
    # kv_cache: up when more requests than this per replica are not yet running.
    max_waiting_per_replica: float = Field(default=2.0, gt=0)
    # kv_cache: prefill and colocated pools scale up when recent mean TTFT exceeds this.
    ttft_target_s: float = Field(default=2.0, gt=0)
    # kv_cache, slo: seconds of observations the KV mean and the prompt-token demand cover (slo: and the
    # output lengths of the requests finished, which its TPOT misses are averaged over).
    window_s: float = Field(default=30.0, gt=0)
    # kv_cache: scale-up sizes KV this many seconds ahead along the window's trend (about a replica's
    # start-up, for long generations whose KV keeps growing); 0 sizes on the window mean.
    kv_lookahead_s: float = Field(default=0.0, ge=0)
    # kv_cache: seconds the load must fit fewer replicas before they are removed; removals are this far apart.
    scale_down_cooldown_s: float = Field(default=120.0, ge=0)
    # kv_cache with min_replicas 0: seconds with no work at all before scaling to zero.
    idle_to_zero_s: float = Field(default=300.0, ge=0)
    # kv_cache, queue_depth: most replicas added (removed) by one decision.
    max_step_up: int = Field(default=2, ge=1)
    max_step_down: int = Field(default=1, ge=1)
    # kv_cache, queue_depth: Kubernetes HPA's stabilization windows: act on the lowest recommendation of
    # the last upscale window (a brief spike adds less), the highest of the last downscale window (a brief
    # lull removes nothing).
    upscale_stabilization_s: float = Field(default=0.0, ge=0)
    downscale_stabilization_s: float = Field(default=60.0, ge=0)
    # kv_cache, queue_depth: how often the policy decides.
    decision_period_s: float = Field(default=1.0, gt=0)
    # How often replicas report their engine's signals to Serve's autoscaler.
    metrics_interval_s: float = Field(default=1.0, gt=0)
    # ray_default: requests per replica Serve aims for (Serve's own default, 2, is far below what an LLM
    # engine batches), and how long a direction must hold before Serve acts on it.
    target_ongoing_requests: float = Field(default=16, gt=0)
    upscale_delay_s: float = Field(default=30, ge=0)
    downscale_delay_s: float = Field(default=600, ge=0)
    # queue_depth: requests not yet finished per replica it aims for (KEDA's queue-length target).
    target_queue_per_replica: float = Field(default=4.0, gt=0)
    # slo: the latency targets a pool is sized to meet at the 99th percentile.
    ttft_p99_s: float | None = Field(default=None, gt=0)
    tpot_p99_s: float | None = Field(default=None, gt=0)
    # slo: what one replica of this model does (its prefill and decode speed, KV capacity, start-up).
    profile: ReplicaProfile | None = None
    # min_replicas 0: requests the ingress holds while the pool wakes from zero replicas; past this, a 503
    # with Retry-After. The held requests are served in arrival order once a replica is up.
    max_held_requests: int = Field(default=64, ge=1)
    # min_replicas 0: how long a held request waits for the pool to wake before it gets a 503.
    hold_timeout_s: float = Field(default=300.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.target_low >= self.target_high:
            raise ValueError(f"target_low ({self.target_low}) must be below target_high ({self.target_high})")
        if self.target_prefill_low >= self.target_prefill_high:
            raise ValueError(f"target_prefill_low ({self.target_prefill_low}) must be below target_prefill_high "
                             f"({self.target_prefill_high})")
        return self

    @model_validator(mode="after")
    def _zero_knobs_need_zero(self) -> AutoscalingConfig:
        set_knobs = [knob for knob in ZERO_KNOBS if knob in self.model_fields_set]
        if set_knobs and self.min_replicas > 0:
            raise ValueError(f"{', '.join(set_knobs)} act only on a pool that scales to zero; set min_replicas: 0 "
                             f"or remove them")
        return self

    @model_validator(mode="after")
    def _slo_inputs(self) -> AutoscalingConfig:
        if self.policy == "slo":
            missing = [knob for knob in ("ttft_p99_s", "tpot_p99_s", "profile") if getattr(self, knob) is None]
            if missing:
                raise ValueError(f"policy slo needs {', '.join(missing)}: it sizes the pool from the SLOs and "
                                 f"a replica profile (benchmarks/autoscaling.py calibrate measures one)")
        return self

    @model_validator(mode="after")
    def _knobs_of_this_policy(self) -> AutoscalingConfig:
        foreign = sorted(self.model_fields_set - COMMON_KNOBS - POLICY_KNOBS[self.policy])
        if foreign:
            owned = [f"{knob} ({'/'.join(sorted(p for p, knobs in POLICY_KNOBS.items() if knob in knobs))} only)"
                     for knob in foreign]
            raise ValueError(f"policy {self.policy} does not read {', '.join(owned)}; remove them or change the policy")
        return self


def check_start_at_zero(replicas: int, autoscaling: AutoscalingConfig | None, subject: str) -> None:
    """Refuses a start with no replica where nothing would ever start one.

    Raises:
        ValueError: ``replicas`` is 0 and ``subject`` does not scale to zero.
    """
    if replicas == 0 and (autoscaling is None or autoscaling.min_replicas > 0):
        raise ValueError(f"replicas: 0 starts the {subject} with no replica, which only a pool that scales to zero "
                         "wakes from: set autoscaling.min_replicas: 0, or replicas of 1 or more")
