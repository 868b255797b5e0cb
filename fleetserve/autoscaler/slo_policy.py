"""The SLO-driven policy: the SRE states p99 TTFT and TPOT targets and a replica profile; the policy derives
its own thresholds from them and sizes the pool for the demand it forecasts one start-up ahead.

Pure Python (no Ray). Each decision:

1. measures demand over the window, in tokens: prompt tokens/s (computed, plus backlog growth, plus the
   backlog itself drained within the TTFT target, as llm-d turns in-flight prefill into seconds of wait),
   KV tokens held, and sequences running or waiting;
2. forecasts each one ``profile.startup_s`` ahead (a replica asked for now serves only then): the level is
   the window's mean, the trend a line fitted over ``TREND_STARTUPS`` start-ups of history (a trend
   fitted over less than the horizon it projects across mostly projects noise), never below the level;
3. finds the fewest replicas that carry the forecast within the SLOs:

   * prefill: utilization at most the largest at which an M/M/1 queue of prompts meets the TTFT target at
     its 99th percentile (``prefill_utilization_for``; ``target_prefill_high`` overrides it);
   * decode: KV at most ``KV_FILL`` of capacity (``target_high`` overrides it), at most ``max_num_seqs``
     sequences, and the p99 time per output token (decode steps plus the prefills that interleave with
     them over a request's life, ``tpot_p99``) within the TPOT target;

4. scales down only to the larger of the most needed over the last ``profile.startup_s``
   (``scale_down_cooldown_s`` overrides it: keeping an idle replica for one start-up costs what bringing
   it back would, the ski-rental rule) and the size that would have carried 99% of the requests of the
   last ``ENVELOPE_STARTUPS`` start-ups (bursts shorter than a start-up cannot be scaled for once they
   come, so a pool whose bursts recur keeps their capacity; the p99 target allows 1% of requests to miss,
   not every burst's).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import fmean, linear_regression

from fleetserve.autoscaler.policy import Decision, PoolObservation, Reason, Stabilizer, prompt_demand
from fleetserve.platform.config import AutoscalingConfig, ReplicaProfile

# Share of KV capacity the pool is sized to fill: vLLM preempts at a full cache, and the forecast of a
# growing KV is a line, not the truth.
KV_FILL = 0.9
# The trend is fitted over this many start-ups of history: its error one start-up ahead is then a small
# share of the level (for per-second demand as bursty as Azure's traces, about 5% of it).
TREND_STARTUPS = 4
# Scale-down keeps the size that would have carried 99% of the requests of this many start-ups of
# history: bursts that recur faster than that keep their capacity (chosen from 5 and 10 on the Azure
# traces: 10 cost more on both for little more attainment).
ENVELOPE_STARTUPS = 5
# The quantile the targets hold for (p99), and the standard normal's value there.
TAIL = 0.01
Z_P99 = 2.326
# The utilization floor when a lone prompt's prefill alone nearly takes the TTFT target: more replicas
# cannot make one prompt faster, so the pool is sized for a short queue rather than none.
MIN_PREFILL_UTILIZATION = 0.1


def prefill_utilization_for(ttft_s: float, service_s: float) -> float:
    """The largest prefill utilization at which a prompt's p99 TTFT stays within ``ttft_s``.

    Prompts queue for a replica's prefill as in an M/M/1 queue with mean service ``service_s`` (mean prompt
    over prefill throughput). Its wait exceeds t with probability ``rho * exp(-(1 - rho) * t / service_s)``,
    so the p99 wait is ``service_s * ln(rho / TAIL) / (1 - rho)``; with the prompt's own prefill that must
    fit ``ttft_s``. Solved for rho by bisection (the wait grows with rho).
    """
    budget = ttft_s - service_s
    if budget <= 0:
        return MIN_PREFILL_UTILIZATION

    def p99_wait(rho: float) -> float:
        return service_s * math.log(rho / TAIL) / (1 - rho) if rho > TAIL else 0.0

    low, high = TAIL, 1.0 - 1e-9
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if p99_wait(middle) <= budget else (low, middle)
    return max(MIN_PREFILL_UTILIZATION, low)


def forecast(times: list[float], values: list[float], horizon_s: float, level_s: float | None = None) -> float:
    """``values`` ``horizon_s`` past the last time: their mean over the last ``level_s`` (all of them when
    None), carried from the middle of that span to the forecast time on their least-squares slope over all
    of them; never below that mean (a falling trend does not shrink the pool: scale-down has its own rule)."""
    recent = [(t, v) for t, v in zip(times, values) if level_s is None or t >= times[-1] - level_s]
    level = fmean(v for _, v in recent)
    if len(set(times)) < 2:
        return level
    slope, _ = linear_regression(times, values)
    middle = fmean(t for t, _ in recent)
    return max(level, level + slope * (times[-1] - middle + horizon_s))


@dataclass(frozen=True)
class Demand:
    """A pool's demand, forecast one start-up ahead."""

    # Prompt tokens/s to prefill, the backlog's drain within the TTFT target included.
    prompt_tokens_per_s: float
    # KV tokens the pool's sequences hold.
    kv_tokens: float
    # Sequences running, waiting in engines or queued in front of the pool.
    num_sequences: float
    # Mean prompt tokens a request brings (what one prefill costs), and mean tokens it generates.
    mean_prompt_tokens: float
    mean_output_tokens: float = 1.0


@dataclass(frozen=True)
class Sizing:
    """The fewest replicas that carry a demand within the SLOs, and the rule that set the count."""

    num_replicas: int
    reason: Reason
    # The prefill utilization the TTFT target allows.
    prefill_utilization: float
    # The p99 TPOT expected at num_replicas (see ``tpot_p99``).
    tpot_p99_s: float


def tpot_p99(profile: ReplicaProfile, demand: Demand, num_replicas: int) -> float:
    """The p99 time per output token on one of ``num_replicas`` replicas sharing ``demand``.

    A step decodes the replica's share of the sequences, each reading its KV: ``d = base + per_seq * b +
    per_kv_token * kv``. Prefills interleave with those steps: a request generating n tokens lives about
    ``n * d / (1 - share)`` seconds, ``share`` being the replica's time in prefill, and over that life K
    prompts arrive to be prefilled, K Poisson-distributed; its TPOT is ``d + K * (prompt / prefill
    speed) / (n - 1)``. The p99 takes K at its mean plus 2.33 standard deviations. A decode pool
    prefills nothing.
    """
    share = 0.0 if demand.mean_prompt_tokens <= 0 else demand.prompt_tokens_per_s / (num_replicas * profile.prefill_tokens_per_s)
    step = (profile.decode_step_base_s + profile.decode_step_per_seq_s * demand.num_sequences / num_replicas
            + profile.decode_step_per_kv_token_s * demand.kv_tokens / num_replicas)
    if share <= 0 or demand.mean_output_tokens <= 1:  # a lone token has no time per output token
        return step
    if share >= 1:
        return math.inf
    prefill_s = demand.mean_prompt_tokens / profile.prefill_tokens_per_s
    prompts_per_s = demand.prompt_tokens_per_s / demand.mean_prompt_tokens / num_replicas
    arrivals = prompts_per_s * demand.mean_output_tokens * step / (1 - share)
    return step + (arrivals + Z_P99 * math.sqrt(arrivals)) * prefill_s / (demand.mean_output_tokens - 1)


class SLOPolicy:
    """Sizes a pool for its forecast demand within p99 TTFT and TPOT targets (see the module docstring).

    Args:
        config: a pool's ``autoscaling:`` with ``policy: slo``, its SLOs and replica profile.
    """

    def __init__(self, config: AutoscalingConfig) -> None:
        if config.profile is None or config.ttft_p99_s is None or config.tpot_p99_s is None:
            raise ValueError("policy slo needs ttft_p99_s, tpot_p99_s and profile")
        self.config = config
        self.profile: ReplicaProfile = config.profile
        self.ttft_s, self.tpot_s = config.ttft_p99_s, config.tpot_p99_s
        given = config.model_fields_set
        self.kv_fill = config.target_high if "target_high" in given else KV_FILL
        self.prefill_utilization = config.target_prefill_high if "target_prefill_high" in given else None
        self.hold_s = config.scale_down_cooldown_s if "scale_down_cooldown_s" in given else self.profile.startup_s
        # The observations of the trend's history (the last window_s of them set the level).
        self.window: deque[PoolObservation] = deque()
        self.history_s = max(config.window_s, TREND_STARTUPS * self.profile.startup_s)
        # (time, replicas needed), over the hold, for scale-down.
        self.needs: deque[tuple[float, int]] = deque()
        # (time, replicas needed, requests served or queued then), over the envelope, for scale-down.
        self.envelope: deque[tuple[float, int, float]] = deque()
        self.envelope_s = ENVELOPE_STARTUPS * self.profile.startup_s
        # How far ahead demand is forecast: a replica asked for now serves one start-up and one decision later.
        self.horizon_s = self.profile.startup_s + config.decision_period_s
        self.idle_since: float | None = None
        # The last measured mean prompt, kept through windows without any first token.
        self.mean_prompt_tokens = float(self.profile.max_num_batched_tokens)
        self.mean_output_tokens = 1.0
        self.stabilizer = Stabilizer(config, hpa_behaviour=False)

    def demand(self) -> Demand:
        """The window's demand, each part forecast one start-up ahead."""
        reporting = [obs for obs in self.window if obs.replicas]
        if not reporting:
            return Demand(0.0, 0.0, float(self.window[-1].num_ongoing) if self.window else 0.0,
                          self.mean_prompt_tokens, self.mean_output_tokens)
        level_s = self.config.window_s
        times = [obs.time_s for obs in reporting]
        recent = [obs for obs in reporting if obs.time_s >= times[-1] - level_s]
        computed = sum(r.prompt_tokens_per_s for obs in recent for r in obs.replicas)
        firsts = sum(r.first_tokens_per_s for obs in recent for r in obs.replicas)
        generated = sum(max(0.0, r.tokens_per_s - r.prompt_tokens_per_s) for obs in recent for r in obs.replicas)
        if firsts > 0 and computed > 0:
            self.mean_prompt_tokens = computed / firsts
        if firsts > 0 and generated > 0:
            self.mean_output_tokens = max(1.0, generated / firsts)
        horizon = self.horizon_s
        demand_times, prompt_rates = prompt_demand(reporting)
        backlog = sum(r.num_pending_prompt_tokens for r in reporting[-1].replicas)
        kv = [sum(r.kv_cache_usage for r in obs.replicas) * self.profile.kv_capacity_tokens for obs in reporting]
        sequences = [float(obs.num_ongoing) for obs in reporting]
        return Demand(forecast(demand_times, prompt_rates, horizon, level_s) + backlog / self.ttft_s,
                      forecast(times, kv, horizon, level_s), forecast(times, sequences, horizon, level_s),
                      self.mean_prompt_tokens, self.mean_output_tokens)

    def size(self, demand: Demand) -> Sizing:
        """The fewest replicas that carry ``demand`` within the SLOs (at most ``max_replicas``)."""
        profile, pool = self.profile, self.config.pool
        utilization = self.prefill_utilization or prefill_utilization_for(
            self.ttft_s - profile.request_overhead_s, demand.mean_prompt_tokens / profile.prefill_tokens_per_s)
        decoding = demand if pool != "decode" else Demand(0.0, demand.kv_tokens, demand.num_sequences, 0.0,
                                                          demand.mean_output_tokens)
        reason: Reason = "slo_prefill" if pool == "prefill" else "slo_kv"
        tpot = math.inf
        for count in range(1, self.config.max_replicas + 1):
            tpot = tpot_p99(profile, decoding, count)
            if pool != "decode" and demand.prompt_tokens_per_s > count * utilization * profile.prefill_tokens_per_s:
                reason = "slo_prefill"
            elif pool != "prefill" and demand.kv_tokens > count * self.kv_fill * profile.kv_capacity_tokens:
                reason = "slo_kv"
            elif pool != "prefill" and demand.num_sequences > count * profile.max_num_seqs:
                reason = "slo_tpot"
            elif pool != "prefill" and tpot > self.tpot_s:
                reason = "slo_tpot"
            else:
                return Sizing(count, reason, utilization, tpot)
        return Sizing(self.config.max_replicas, reason, utilization, tpot)

    def _envelope(self, observation: PoolObservation, need: int) -> int:
        """The size that would have carried all but ``TAIL`` of the envelope's requests: its needs, each
        weighted by the requests served or queued when it was measured."""
        now = observation.time_s
        weight = sum(r.first_tokens_per_s for r in observation.replicas) + observation.num_queued
        self.envelope.append((now, need, weight))
        while self.envelope[0][0] < now - self.envelope_s:
            self.envelope.popleft()
        total = sum(w for _, _, w in self.envelope)
        covered = 0.0
        for _, count, w in sorted(self.envelope, key=lambda entry: entry[1]):
            covered += w
            if covered >= (1 - TAIL) * total > 0:
                return count
        return need

    def decide(self, observation: PoolObservation) -> Decision:
        """The desired replica count for this observation (the policy keeps its own window)."""
        config, now, current = self.config, observation.time_s, observation.num_replicas
        self.window.append(observation)
        while self.window and self.window[0].time_s < now - self.history_s:
            self.window.popleft()
        idle = observation.num_ongoing == 0
        self.idle_since = (self.idle_since if self.idle_since is not None else now) if idle else None
        if current == 0:
            if not idle:
                return Decision(max(1, config.min_replicas), "wake", f"{observation.num_ongoing} request(s) arrived "
                                                                       "with no replica")
            return Decision(0, "hold", "scaled to zero, no work")
        if config.min_replicas == 0 and idle and now - self.idle_since >= config.idle_to_zero_s:
            return Decision(0, "idle_to_zero", f"no work for {now - self.idle_since:.0f}s")
        demand = self.demand()
        sizing = self.size(demand)
        self.needs.append((now, sizing.num_replicas))
        while self.needs[0][0] < now - self.hold_s:
            self.needs.popleft()
        held = max(max(count for _, count in self.needs), self._envelope(observation, sizing.num_replicas))
        detail = (f"forecast {self.horizon_s:g}s ahead: {demand.prompt_tokens_per_s:,.0f} prompt tokens/s "
                  f"(utilization <= {sizing.prefill_utilization:.2f} for TTFT p99 {self.ttft_s:g}s at "
                  f"{demand.mean_prompt_tokens:,.0f}-token prompts), {demand.kv_tokens:,.0f} KV tokens, "
                  f"{demand.num_sequences:.1f} sequences of {demand.mean_output_tokens:,.0f} tokens (TPOT p99 "
                  f"{sizing.tpot_p99_s * 1000:.0f}ms of {self.tpot_s * 1000:g}ms): needs {sizing.num_replicas}")
        if sizing.num_replicas > current:
            return self.stabilizer.apply(now, current, Decision(sizing.num_replicas, sizing.reason, detail))
        if held < current:
            return self.stabilizer.apply(now, current, Decision(held, "slo_down", f"{detail}; most needed over the "
                                                                                 f"last {self.hold_s:g}s: {held}"))
        return self.stabilizer.apply(now, current, Decision(current, "hold", detail))
