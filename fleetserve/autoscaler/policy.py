"""Autoscaling policies: a window of per-replica signals in, a desired replica count and its reason out.

Pure Python (no Ray). Every policy takes the platform's own ``AutoscalingConfig`` (a model's
``autoscaling:`` block), so what the simulator replays is what the platform serves. ``KVCachePolicy`` is
fleetserve's: it scales a pool on what fills it, KV-cache usage and queued work, with the knobs of
Kubernetes HPA behaviour (stabilization windows, step limits, min/max). ``OngoingRequestsPolicy``
re-implements Ray Serve's default (``ray_default``) and ``QueueDepthPolicy`` a KEDA-style queue-length
scaler (``queue_depth``), so the simulator can compare all three on the same trace.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import fmean, linear_regression
from typing import Literal, Protocol

from fleetserve.platform.config import AutoscalingConfig
from fleetserve.platform.replica_report import ReplicaReport

# Why a decision came out as it did; every decision carries exactly one.
Reason = Literal["hold", "kv_high", "prefill_high", "queue", "ttft", "kv_low", "prefill_low", "cooldown",
                 "idle_to_zero", "wake",
                 "min_replicas", "max_replicas", "stabilizing", "ongoing_requests", "queue_depth",
                 "slo_prefill", "slo_kv", "slo_tpot", "slo_down", "pd_ratio"]


@dataclass(frozen=True)
class PoolObservation:
    """A pool at one moment: its replicas' reports and the work queued in front of it."""

    time_s: float
    # Replicas running (those in ``replicas``) plus any still starting.
    num_replicas: int
    # The reports of the replicas that are running; starting ones have none yet.
    replicas: tuple[ReplicaReport, ...] = ()
    # Requests waiting in front of the pool (router or handle queues), on no replica yet.
    num_queued: int = 0

    @property
    def num_waiting(self) -> int:
        """Every request not yet running: queued in front plus waiting inside engines."""
        return self.num_queued + sum(r.num_waiting for r in self.replicas)

    @property
    def num_ongoing(self) -> int:
        return self.num_waiting + sum(r.num_running for r in self.replicas)


@dataclass(frozen=True)
class Decision:
    """A desired replica count and why."""

    desired_replicas: int
    reason: Reason
    # The numbers behind it, for logs.
    detail: str = ""


class Policy(Protocol):
    def decide(self, observation: PoolObservation) -> Decision: ...


class Stabilizer:
    """Step limits, stabilization windows and min/max, applied to a raw recommendation.

    Args:
        config: the pool's autoscaling config (min/max, steps, stabilization windows).
        hpa_behaviour: apply the step limits and stabilization windows; False applies min/max alone (as
            Ray Serve does for its own policy).
    """

    def __init__(self, config: AutoscalingConfig, hpa_behaviour: bool = True) -> None:
        self.limits = config
        self.hpa_behaviour = hpa_behaviour
        self.history: deque[tuple[float, int]] = deque()

    def apply(self, now: float, current: int, raw: Decision, record: bool = True) -> Decision:
        """Applies the limits to ``raw``; ``record=False`` keeps it out of the stabilization windows
        (a policy's own cooldown already delays it; counting it twice would block scale-down forever)."""
        limits = self.limits
        desired, reason = raw.desired_replicas, raw.reason
        if self.hpa_behaviour:
            desired, reason = self._stabilized(now, current, desired, reason, record)
            desired = min(desired, current + limits.max_step_up) if desired > current else max(
                desired, current - limits.max_step_down)
        if desired < limits.min_replicas:
            desired, reason = limits.min_replicas, "min_replicas"
        elif desired > limits.max_replicas:
            # A step up that the cap trims still says what asked for it; at the cap already, the cap is why.
            if current >= limits.max_replicas:
                return Decision(limits.max_replicas, "max_replicas", f"{raw.detail}; wanted {desired}")
            desired = limits.max_replicas
            return Decision(desired, reason, f"{raw.detail}; capped at max_replicas {desired}")
        return Decision(desired, reason, raw.detail)

    def _stabilized(self, now: float, current: int, desired: int, reason: Reason, record: bool) -> tuple[int, Reason]:
        limits = self.limits
        if record:
            self.history.append((now, desired))
        horizon = max(limits.upscale_stabilization_s, limits.downscale_stabilization_s)
        while self.history and self.history[0][0] < now - horizon:
            self.history.popleft()
        if desired > current and limits.upscale_stabilization_s > 0:
            stable = min((d for t, d in self.history if t > now - limits.upscale_stabilization_s), default=desired)
            if stable < desired:
                return max(stable, current), "stabilizing"
        elif desired < current and limits.downscale_stabilization_s > 0:
            stable = max((d for t, d in self.history if t > now - limits.downscale_stabilization_s), default=desired)
            if stable > desired:
                return min(stable, current), "stabilizing"
        return desired, reason


def prompt_demand(reporting: list[PoolObservation]) -> tuple[list[float], list[float]]:
    """Prompt-token demand (tokens/s) over each interval between observations, with the interval's end time:
    the prompt tokens computed, plus how fast the backlog grew. A lone observation has no interval: what
    it computed."""
    times = [obs.time_s for obs in reporting]
    computed = [sum(r.prompt_tokens_per_s for r in obs.replicas) for obs in reporting]
    backlog = [sum(r.num_pending_prompt_tokens for r in obs.replicas) for obs in reporting]
    intervals = [i for i in range(1, len(reporting)) if times[i] > times[i - 1]]
    if not intervals:
        return times[-1:], computed[-1:]
    return ([times[i] for i in intervals],
            [computed[i] + (backlog[i] - backlog[i - 1]) / (times[i] - times[i - 1]) for i in intervals])


@dataclass(frozen=True)
class PoolLoad:
    """What a pool's ready replicas carry, in replicas' worth, averaged over the policy's window."""

    # Sum of the replicas' KV usage: 1.0 is one replica's whole KV cache.
    kv: float
    # The same, projected ``kv_lookahead_s`` ahead along the window's trend (never below ``kv``).
    kv_ahead: float
    # Prompt-token demand (computed plus backlog growth) over one replica's prefill throughput;
    # None without a prefill throughput.
    prefill: float | None


class KVCachePolicy:
    """Scales a pool on what fills it: KV-cache usage, prefill work and queued requests.

    Each rule sizes the pool from the load its ready replicas carry, and compares that size with every
    replica it has, starting ones included, so a scale-up under way is not asked for twice:

    * KV (decode, colocated): ``ceil(sum of KV usage / target_high)`` once mean usage exceeds it (with
      ``kv_lookahead_s``, the sum projected that far ahead along the window's trend, if higher);
    * prefill work (prefill, colocated, with ``prefill_tokens_per_s``): ``ceil(demand /
      (prefill_tokens_per_s * target_prefill_high))`` once demand exceeds that share of the pool;
    * queue (all): ``ceil(waiting / max_waiting_per_replica)`` once more than that many per replica wait;
    * TTFT (prefill, colocated): one more replica while recent mean TTFT exceeds ``ttft_target_s`` and
      none is starting (TTFT is not proportional to replicas);
    * down: once the load fits fewer replicas at the low targets (and the requests waiting fit them at
      ``max_waiting_per_replica``) for ``scale_down_cooldown_s``, to the largest such count seen over that
      cooldown; between the high and low targets it holds (hysteresis), and it never shrinks while a
      replica is starting;
    * with ``min_replicas: 0``, to zero after ``idle_to_zero_s`` without work, and back to one on the
      first queued request.
    """

    def __init__(self, config: AutoscalingConfig = AutoscalingConfig()) -> None:
        self.config = config
        self.window: deque[PoolObservation] = deque()
        self.low_since: float | None = None
        self.idle_since: float | None = None
        # (time, replicas the load fits at the low targets) since the load went low, for scale-down.
        self.low_counts: deque[tuple[float, int]] = deque()
        self.stabilizer = Stabilizer(config)

    def _load(self) -> PoolLoad:
        reporting = [obs for obs in self.window if obs.replicas]
        if not reporting:
            return PoolLoad(0.0, 0.0, None if self.config.prefill_tokens_per_s is None else 0.0)
        times = [obs.time_s for obs in reporting]
        kv_sums = [sum(r.kv_cache_usage for r in obs.replicas) for obs in reporting]
        kv = kv_ahead = fmean(kv_sums)
        if self.config.kv_lookahead_s > 0 and len(set(times)) > 1:
            slope, intercept = linear_regression(times, kv_sums)
            kv_ahead = max(kv, intercept + slope * (times[-1] + self.config.kv_lookahead_s))
        if self.config.prefill_tokens_per_s is None:
            return PoolLoad(kv, kv_ahead, None)
        _, demand = prompt_demand(reporting)
        return PoolLoad(kv, kv_ahead, max(0.0, fmean(demand)) / self.config.prefill_tokens_per_s)

    def _sizes(self, load: PoolLoad, high: bool) -> list[tuple[int, Reason]]:
        """Replicas the load needs at the high (or low) targets, per rule that applies to this pool."""
        config = self.config
        sizes: list[tuple[int, Reason]] = []
        # A prefill pool's KV is transient; without a prefill throughput it is still the only load to shrink on.
        if config.pool != "prefill" or (not high and load.prefill is None):
            kv = load.kv_ahead if high else load.kv
            sizes.append((math.ceil(kv / (config.target_high if high else config.target_low) - 1e-9),
                          "kv_high" if high else "kv_low"))
        if config.pool != "decode" and load.prefill is not None:
            target = config.target_prefill_high if high else config.target_prefill_low
            sizes.append((math.ceil(load.prefill / target - 1e-9), "prefill_high" if high else "prefill_low"))
        return sizes

    def _raw(self, obs: PoolObservation) -> Decision:
        config, current = self.config, obs.num_replicas
        if current == 0:
            if obs.num_ongoing > 0:
                return Decision(1, "wake", f"{obs.num_ongoing} request(s) arrived with no replica")
            return Decision(0, "hold", "scaled to zero, no work")
        load = self._load()
        ready = len(obs.replicas)
        starting = max(0, current - ready)
        waiting_per_replica = obs.num_waiting / current
        ttfts = [r.ttft_s for r in obs.replicas if r.ttft_s is not None]
        ttft = fmean(ttfts) if ttfts else None
        mean_kv = load.kv / ready if ready else 0.0
        prefill = "" if load.prefill is None else f", prefill {load.prefill:.2f} replicas' worth"
        ahead = (f" ({load.kv_ahead / ready:.2f} {config.kv_lookahead_s:g}s ahead)"
                 if config.kv_lookahead_s > 0 and ready else "")
        detail = (f"kv {mean_kv:.2f} over {config.window_s:g}s{ahead}{prefill}, waiting {obs.num_waiting} "
                  f"({waiting_per_replica:.1f}/replica), ttft {ttft if ttft is None else round(ttft, 3)}"
                  + (f", {starting} starting" if starting else ""))
        wants = [(size, reason) for size, reason in self._sizes(load, high=True) if size > current]
        if waiting_per_replica > config.max_waiting_per_replica:
            wants.append((math.ceil(obs.num_waiting / config.max_waiting_per_replica), "queue"))
        if config.pool != "decode" and ttft is not None and ttft > config.ttft_target_s and not starting:
            wants.append((current + 1, "ttft"))
        if wants:
            self.low_since = self.idle_since = None
            self.low_counts.clear()
            desired, reason = max(wants, key=lambda want: want[0])
            return Decision(max(desired, current + 1), reason, detail)
        return self._maybe_down(obs, load, detail)

    def _maybe_down(self, obs: PoolObservation, load: PoolLoad, detail: str) -> Decision:
        config, current, now = self.config, obs.num_replicas, obs.time_s
        idle = obs.num_ongoing == 0
        self.idle_since = (self.idle_since if self.idle_since is not None else now) if idle else None
        if config.min_replicas == 0 and idle and now - self.idle_since >= config.idle_to_zero_s:
            return Decision(0, "idle_to_zero", f"no work for {now - self.idle_since:.0f}s")
        fits, reason = max(self._sizes(load, high=False), key=lambda size: size[0])
        # Never so few that the requests waiting now would ask for a replica back.
        fits = max(fits, math.ceil(obs.num_waiting / config.max_waiting_per_replica), config.min_replicas, 1)
        if fits >= current or len(obs.replicas) < current:
            self.low_since = None
            self.low_counts.clear()
            return Decision(current, "hold", detail)
        self.low_since = self.low_since if self.low_since is not None else now
        self.low_counts.append((now, fits))
        while self.low_counts[0][0] < now - config.scale_down_cooldown_s:
            self.low_counts.popleft()
        if now - self.low_since >= config.scale_down_cooldown_s:
            self.low_since = now  # the next removal waits a full cooldown again
            desired = max(count for _, count in self.low_counts)
            self.low_counts.clear()
            return Decision(desired, reason, f"{detail}; fits {desired} at the low targets")
        return Decision(current, "cooldown", f"{detail}; low for {now - self.low_since:.0f}s")

    def decide(self, observation: PoolObservation) -> Decision:
        """The desired replica count for this observation (the policy keeps its own window)."""
        self.window.append(observation)
        while self.window and self.window[0].time_s < observation.time_s - self.config.window_s:
            self.window.popleft()
        raw = self._raw(observation)
        if raw.reason == "wake":
            return Decision(max(1, self.config.min_replicas), "wake", raw.detail)
        return self.stabilizer.apply(observation.time_s, observation.num_replicas, raw, record=raw.reason != "cooldown")


class OngoingRequestsPolicy:
    """Ray Serve's default: ``ceil(ongoing / target_ongoing_requests)``, applied only after the same
    direction has been recommended for the upscale (downscale) delay."""

    def __init__(self, config: AutoscalingConfig = AutoscalingConfig(policy="ray_default")) -> None:
        self.config = config
        self.direction_since: tuple[int, float] | None = None
        self.stabilizer = Stabilizer(config, hpa_behaviour=False)

    def decide(self, observation: PoolObservation) -> Decision:
        config, current, now = self.config, observation.num_replicas, observation.time_s
        wanted = math.ceil(observation.num_ongoing / config.target_ongoing_requests)
        detail = f"{observation.num_ongoing} ongoing / {config.target_ongoing_requests:g} per replica"
        direction = (wanted > current) - (wanted < current)
        if direction == 0:
            self.direction_since = None
            return self.stabilizer.apply(now, current, Decision(current, "hold", detail))
        if self.direction_since is None or self.direction_since[0] != direction:
            self.direction_since = (direction, now)
        delay = config.upscale_delay_s if direction > 0 else config.downscale_delay_s
        if now - self.direction_since[1] < delay:
            return self.stabilizer.apply(now, current, Decision(current, "cooldown", detail))
        self.direction_since = None
        return self.stabilizer.apply(now, current, Decision(wanted, "ongoing_requests", detail))


class QueueDepthPolicy:
    """Scales on requests not yet running (what an external queue-length metric would show KEDA)."""

    def __init__(self, config: AutoscalingConfig = AutoscalingConfig(policy="queue_depth")) -> None:
        self.config = config
        self.stabilizer = Stabilizer(config)

    def decide(self, observation: PoolObservation) -> Decision:
        ongoing = observation.num_ongoing
        wanted = math.ceil(ongoing / self.config.target_queue_per_replica)
        return self.stabilizer.apply(observation.time_s, observation.num_replicas,
                                     Decision(wanted, "queue_depth", f"{ongoing} ongoing"))
