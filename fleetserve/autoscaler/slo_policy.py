"""The SLO-driven policy: the SRE states p99 TTFT and TPOT targets and a replica profile; the policy sizes
the pool so that at most 1% of requests miss them, for the demand it forecasts one start-up ahead.

Pure Python (no Ray). Each decision:

1. measures demand over the window, in tokens: prompt tokens/s (computed, plus backlog growth, plus what
   the backlog adds if it is to be drained within the TTFT target), KV tokens held, and
   sequences running or waiting; and the mean prompt and output a request brings (computed prompt tokens
   and generated tokens per first token);
2. forecasts each one ``profile.startup_s`` ahead (a replica asked for now serves only then): the level is
   the window's mean, the trend a line fitted over ``TREND_STARTUPS`` start-ups of history (a trend fitted
   over less than the horizon it projects across mostly projects noise), never below the level;
3. finds the fewest replicas at which the share of requests expected to miss an SLO, beyond what no number
   of replicas would avoid, is at most ``TAIL`` (``miss_shares``): TTFT as an M/M/1 queue of prompts over
   the prefill throughput, TPOT as the decode step plus the prefills that interleave with a request's
   life, over the output lengths of the requests the pool finished in the window (exponential with the
   measured mean while fewer than ``LENGTHS_MIN_FINISHED`` did). KV stays within ``KV_FILL`` of capacity
   (``target_high`` overrides it) and sequences within ``max_num_seqs``; ``target_prefill_high``, when set,
   caps prefill utilization as well;
4. scales down only to the larger of the most needed over the last ``profile.startup_s``
   (``scale_down_cooldown_s`` overrides it: keeping an idle replica for one start-up costs what bringing
   it back would, the ski-rental rule) and the size that would have carried 99% of the requests of the
   last ``ENVELOPE_STARTUPS`` start-ups, at least ``ENVELOPE_MIN_S`` (bursts shorter than a start-up
   cannot be scaled for once they come, so a pool whose bursts recur keeps their capacity; the p99 target
   allows 1% of requests to miss, not every burst's).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean, linear_regression

import numpy as np
from scipy.stats import poisson

from fleetserve.autoscaler.policy import Decision, PoolObservation, Reason, Stabilizer, prompt_demand
from fleetserve.platform.config import AutoscalingConfig, ReplicaProfile
from fleetserve.platform.output_lengths import bucket_lengths

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
# ... and of at least this many seconds (Kubernetes HPA's default scale-down stabilization window): how
# often bursts recur is the traffic's, not the replica's, so a short start-up must not shorten the
# envelope below the lulls between bursts (with 10-30 s start-ups, five of them released the Azure code
# trace's capacity between its bursts: 80-85% attainment).
ENVELOPE_MIN_S = 300.0
# The share of requests allowed to miss an SLO: the targets are p99s.
TAIL = 0.01
# Until the pool has measured the output lengths of this many finished requests, they are taken as
# exponential with the measured mean, at OUTPUT_QUANTILES. That guess is far off on real traffic: it puts
# 2.3% of Azure's conversation answers at 5 tokens or fewer, where there are none, and cost 17% more
# replica-seconds there than the measured lengths at the same attainment.
LENGTHS_MIN_FINISHED = 50
OUTPUT_QUANTILES = (np.arange(64) + 0.5) / 64
BUCKET_LENGTHS = bucket_lengths()


def forecast(times: list[float], values: list[float], horizon_s: float, level_s: float | None = None) -> float:
    """``values`` ``horizon_s`` past the last time: their mean over the last ``level_s`` (all of them when
    None), carried from the middle of that span to the forecast time on their least-squares slope over all
    of them; never below that mean (a falling trend does not shrink the pool: scale-down has its own rule).
    Until the values span ``horizon_s``, the mean alone: a slope from less history than the distance it is
    projected over projects mostly noise."""
    recent = [(t, v) for t, v in zip(times, values) if level_s is None or t >= times[-1] - level_s]
    level = fmean(v for _, v in recent)
    if len(set(times)) < 2 or times[-1] - times[0] < horizon_s:
        return level
    slope, _ = linear_regression(times, values)
    middle = fmean(t for t, _ in recent)
    return max(level, level + slope * (times[-1] - middle + horizon_s))


@dataclass(frozen=True)
class Demand:
    """A pool's demand, forecast one start-up ahead."""

    # Prompt tokens/s to prefill.
    prompt_tokens_per_s: float
    # KV tokens the pool's sequences hold.
    kv_tokens: float
    # Sequences running, waiting in engines or queued in front of the pool.
    num_sequences: float
    # Mean prompt tokens a request brings (what one prefill costs; 0 before any first token was seen, when
    # no queueing is modelled), and mean tokens it generates.
    mean_prompt_tokens: float
    mean_output_tokens: float = 1.0
    # Share of finished requests whose output fell in each bucket of OUTPUT_LENGTH_EDGES; empty until
    # enough have finished (then output lengths are taken as exponential with mean_output_tokens).
    output_length_shares: tuple[float, ...] = ()


@dataclass(frozen=True)
class MissShares:
    """Shares of requests expected to miss each SLO on one of ``num_replicas`` replicas sharing a demand."""

    ttft: float
    tpot: float
    # The share of a replica's time spent prefilling, and its decode step.
    prefill_share: float
    decode_step_s: float


def ttft_miss_share(prefill_share: float, service_s: float, ttft_s: float) -> float:
    """P(TTFT > ``ttft_s``) with prompts queued for prefill as in an M/M/1 queue (utilization
    ``prefill_share``, mean service ``service_s``): its time in system is exponential with rate
    ``(1 - share) / service_s``."""
    if prefill_share >= 1:
        return 1.0
    if service_s <= 0 or ttft_s <= 0:
        return 0.0 if ttft_s > 0 else 1.0
    return math.exp(-(1 - prefill_share) * ttft_s / service_s)


def tpot_miss_share(decode_step_s: float, prefill_share: float, prompts_per_s: float, service_s: float,
                    mean_output_tokens: float, tpot_s: float, output_length_shares: Sequence[float] = ()) -> float:
    """The share of requests whose time per output token exceeds ``tpot_s``.

    A request generating n tokens decodes one per step of ``decode_step_s`` and lives about ``n * step /
    (1 - prefill_share)``; the K prompts that arrive meanwhile (Poisson, ``prompts_per_s``) each stall its
    steps for ``service_s``, so its TPOT is ``step + K * service_s / (n - 1)``. It misses when K exceeds
    ``(tpot_s - step) * (n - 1) / service_s``. Averaged over the output lengths measured
    (``output_length_shares``, by bucket of OUTPUT_LENGTH_EDGES, each at its ``bucket_lengths``), or, when
    none are given, over exponential ones with the given mean; a single-token answer has no TPOT to miss.
    """
    if decode_step_s >= tpot_s or prefill_share >= 1:
        return 1.0 if mean_output_tokens > 1 else 0.0
    if prefill_share <= 0 or prompts_per_s <= 0 or service_s <= 0 or mean_output_tokens <= 1:
        return 0.0
    if output_length_shares:
        shares = np.asarray(output_length_shares)
        used = shares > 0
        misses = tpot_miss_given_output(BUCKET_LENGTHS[used], decode_step_s, prefill_share, prompts_per_s, service_s,
                                        tpot_s)
        return float(np.dot(shares[used], misses) / shares.sum())
    outputs = 1 + (mean_output_tokens - 1) * -np.log1p(-OUTPUT_QUANTILES)
    return float(tpot_miss_given_output(outputs, decode_step_s, prefill_share, prompts_per_s, service_s, tpot_s).mean())


def tpot_miss_given_output(outputs: np.ndarray, decode_step_s: float, prefill_share: float, prompts_per_s: float,
                           service_s: float, tpot_s: float) -> np.ndarray:
    """P(TPOT > ``tpot_s``) for requests generating each of ``outputs`` tokens (see ``tpot_miss_share``)."""
    arrivals = prompts_per_s * outputs * decode_step_s / (1 - prefill_share)
    # The most stalls the request can take; the epsilon keeps an exact quotient from rounding down.
    allowed = np.floor((tpot_s - decode_step_s) * (outputs - 1) / service_s + 1e-9)
    return np.where(outputs >= 2, poisson.sf(allowed, arrivals), 0.0)


def miss_shares(profile: ReplicaProfile, demand: Demand, num_replicas: float, ttft_s: float, tpot_s: float,
                prefills: bool = True, decodes: bool = True) -> MissShares:
    """The shares of requests expected to miss TTFT and TPOT on one of ``num_replicas`` replicas sharing
    ``demand`` (``math.inf``: what remains with unlimited replicas); a pool that does not prefill (decode)
    or decode (prefill) misses nothing there."""
    share = demand.prompt_tokens_per_s / (num_replicas * profile.prefill_tokens_per_s) if prefills else 0.0
    step = (profile.decode_step_base_s + profile.decode_step_per_seq_s * demand.num_sequences / num_replicas
            + profile.decode_step_per_kv_token_s * demand.kv_tokens / num_replicas)
    service_s = demand.mean_prompt_tokens / profile.prefill_tokens_per_s
    ttft = ttft_miss_share(share, service_s, ttft_s - profile.request_overhead_s) if prefills else 0.0
    prompts_per_s = demand.prompt_tokens_per_s / demand.mean_prompt_tokens / num_replicas if demand.mean_prompt_tokens else 0.0
    tpot = (tpot_miss_share(step, share, prompts_per_s, service_s, demand.mean_output_tokens, tpot_s,
                            demand.output_length_shares) if decodes else 0.0)
    return MissShares(ttft, tpot, share, step)


@dataclass(frozen=True)
class Sizing:
    """The fewest replicas that carry a demand within the SLOs, the rule that set the count, and the
    expected misses there."""

    num_replicas: int
    reason: Reason
    misses: MissShares


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
        self.max_prefill_share = config.target_prefill_high if "target_prefill_high" in given else None
        self.hold_s = config.scale_down_cooldown_s if "scale_down_cooldown_s" in given else self.profile.startup_s
        # The observations of the trend's history (the last window_s of them set the level).
        self.window: deque[PoolObservation] = deque()
        self.history_s = max(config.window_s, TREND_STARTUPS * self.profile.startup_s)
        # (time, replicas needed), over the hold, for scale-down.
        self.needs: deque[tuple[float, int]] = deque()
        # (time, replicas needed, requests served or queued then), over the envelope, for scale-down.
        self.envelope: deque[tuple[float, int, float]] = deque()
        self.envelope_s = max(ENVELOPE_STARTUPS * self.profile.startup_s, ENVELOPE_MIN_S)
        # How far ahead demand is forecast: a replica asked for now serves one start-up and one decision later.
        self.horizon_s = self.profile.startup_s + config.decision_period_s
        # The backlog counts as demand drained within the TTFT target: a prompt queued longer misses. Spread
        # over a start-up instead (new capacity takes only what is left of it), the pool held too little for
        # bursts that recur: 97.4% on the Azure code trace against 99.5%.
        self.backlog_drain_s = self.ttft_s
        self.idle_since: float | None = None
        # The last measured mean prompt and output, kept through windows without any first token.
        self.mean_prompt_tokens = 0.0
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
        generated = sum(r.generated_tokens_per_s for obs in recent for r in obs.replicas)
        firsts = sum(r.first_tokens_per_s for obs in recent for r in obs.replicas)
        if firsts > 0 and computed > 0:
            self.mean_prompt_tokens = computed / firsts
        if firsts > 0 and generated > 0:
            self.mean_output_tokens = max(1.0, generated / firsts)
        demand_times, prompt_rates = prompt_demand(reporting)
        backlog = sum(r.num_pending_prompt_tokens for r in reporting[-1].replicas)
        kv = [sum(r.kv_cache_usage for r in obs.replicas) * self.profile.kv_capacity_tokens for obs in reporting]
        sequences = [float(obs.num_ongoing) for obs in reporting]
        horizon = self.horizon_s
        return Demand(forecast(demand_times, prompt_rates, horizon, level_s) + backlog / self.backlog_drain_s,
                      forecast(times, kv, horizon, level_s), forecast(times, sequences, horizon, level_s),
                      self.mean_prompt_tokens, self.mean_output_tokens, self._output_length_shares(recent))

    def _output_length_shares(self, recent: list[PoolObservation]) -> tuple[float, ...]:
        """The requests the window's observations saw finish, by output-length bucket, as shares; empty below
        ``LENGTHS_MIN_FINISHED`` of them. The window is the one that sets the mean output: over the envelope,
        the lengths lagged a change of traffic by minutes (the Azure traces back to back: 98.5% attainment as
        code followed conversation, against 99.4%)."""
        rates = [r.finished_per_s_by_length for obs in recent for r in obs.replicas if r.finished_per_s_by_length]
        if not rates:
            return ()
        counts = np.sum(rates, axis=0) * self.config.decision_period_s
        total = float(counts.sum())
        return tuple(float(c) for c in counts / total) if total >= LENGTHS_MIN_FINISHED else ()

    def size(self, demand: Demand) -> Sizing:
        """The fewest replicas that carry ``demand`` within the SLOs (at most ``max_replicas``)."""
        profile, pool = self.profile, self.config.pool
        prefills, decodes = pool != "decode", pool != "prefill"
        reason: Reason = "slo_prefill" if pool == "prefill" else "slo_kv"
        # What no number of replicas removes (a prompt whose own prefill takes the TTFT target; steps slower
        # than the TPOT target on an empty replica) is not a reason to add one.
        floor = miss_shares(profile, demand, math.inf, self.ttft_s, self.tpot_s, prefills, decodes)
        for count in range(1, self.config.max_replicas + 1):
            misses = miss_shares(profile, demand, count, self.ttft_s, self.tpot_s, prefills, decodes)
            if decodes and demand.kv_tokens > count * self.kv_fill * profile.kv_capacity_tokens:
                reason = "slo_kv"
            elif decodes and demand.num_sequences > count * profile.max_num_seqs:
                reason = "slo_tpot"
            elif self.max_prefill_share is not None and misses.prefill_share > self.max_prefill_share:
                reason = "slo_prefill"
            elif (misses.ttft - floor.ttft) + (misses.tpot - floor.tpot) > TAIL:
                reason = "slo_prefill" if misses.ttft - floor.ttft >= misses.tpot - floor.tpot else "slo_tpot"
            else:
                return Sizing(count, reason, misses)
        return Sizing(self.config.max_replicas, reason, misses)

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
        if not self.needs:  # the replicas the pool starts with are held one start-up too, as any it asks for
            self.needs.append((now, current))
        self.needs.append((now, sizing.num_replicas))
        while self.needs[0][0] < now - self.hold_s:
            self.needs.popleft()
        held = max(max(count for _, count in self.needs), self._envelope(observation, sizing.num_replicas))
        misses = sizing.misses
        detail = (f"forecast {self.horizon_s:g}s ahead: {demand.prompt_tokens_per_s:,.0f} prompt tokens/s of "
                  f"{demand.mean_prompt_tokens:,.0f}-token prompts, {demand.kv_tokens:,.0f} KV tokens, "
                  f"{demand.num_sequences:.1f} sequences of {demand.mean_output_tokens:,.0f} tokens "
                  f"({'lengths measured' if demand.output_length_shares else 'lengths taken as exponential'}): "
                  f"{sizing.num_replicas} replica(s) miss TTFT {self.ttft_s:g}s for {misses.ttft:.2%} and TPOT "
                  f"{self.tpot_s * 1000:g}ms for {misses.tpot:.2%} (prefill {misses.prefill_share:.0%} of the "
                  f"time, {misses.decode_step_s * 1000:.1f}ms steps)")
        if sizing.num_replicas > current:
            return self.stabilizer.apply(now, current, Decision(sizing.num_replicas, sizing.reason, detail))
        if held < current:
            return self.stabilizer.apply(now, current, Decision(held, "slo_down", f"{detail}; most needed over the "
                                                                                 f"last {self.hold_s:g}s: {held}"))
        return self.stabilizer.apply(now, current, Decision(current, "hold", detail))
