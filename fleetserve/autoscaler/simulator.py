"""A trace-driven simulator of one autoscaled pool, for tuning policies before production.

Each replica is an engine with a KV capacity in tokens, a prefill speed and a decode step time that
grows with the batch (a measured ``ReplicaProfile``), and a start-up delay. Requests arrive and queue in
front of the pool; the router sends each, in order, to the replica with the most unclaimed KV once its
prompt fits there. Each replica schedules as vLLM v1 does: running requests first (decodes one token,
prefills a chunk of the step's token budget: chunked prefill), KV allocated as tokens are computed, the
newest running request preempted and later recomputed when KV runs out, and waiting requests admitted
only in steps that preempted nothing. Replicas advance step by step on their own clocks; the policy is
asked every ``decision_interval_s`` with the same signals real replicas report (KV usage, running and
waiting, recent TTFT, prompt tokens computed and the prefill backlog) plus the queue."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import fmean

import numpy as np

from fleetserve.autoscaler.policy import Decision, Policy, PoolObservation
from fleetserve.platform.config import ReplicaProfile
from fleetserve.platform.output_lengths import count_lengths
from fleetserve.platform.replica_report import ReplicaReport
from fleetserve.autoscaler.traces import TraceRequest


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet to count as served well."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


def step_duration(profile: ReplicaProfile, num_decodes: int, num_decode_kv_tokens: int, num_prefill_tokens: int) -> float:
    """Seconds one engine step takes: decoding ``num_decodes`` sequences that hold ``num_decode_kv_tokens`` of KV,
    plus prefilling ``num_prefill_tokens``."""
    return (profile.decode_step_base_s + profile.decode_step_per_seq_s * num_decodes
            + profile.decode_step_per_kv_token_s * num_decode_kv_tokens
            + num_prefill_tokens / profile.prefill_tokens_per_s)


@dataclass
class _Request:
    spec: TraceRequest
    # Tokens to compute before the next decode: the prompt, or after a preemption the prompt plus the
    # output so far (vLLM recomputes a preempted request rather than swapping its KV out).
    to_prefill: int = -1
    prefilled: int = 0
    generated: int = 0
    # Tokens whose KV this request holds on its replica (allocated as computed, freed on preemption).
    kv_tokens: int = 0
    num_preemptions: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None

    def __post_init__(self) -> None:
        if self.to_prefill < 0:
            self.to_prefill = self.spec.prompt_tokens


@dataclass
class _Replica:
    ready_s: float
    clock_s: float
    draining: bool = False
    # Scheduled requests, oldest first (the newest is preempted first).
    running: list[_Request] = field(default_factory=list)
    # Routed here but not scheduled yet; preempted requests go back to the front.
    waiting: deque[_Request] = field(default_factory=deque)
    recent_ttfts: list[float] = field(default_factory=list)
    # Prompt tokens prefilled, and tokens generated, since the last decision (what the engine reports).
    recent_prompt_tokens: int = 0
    recent_generated_tokens: int = 0
    # Output lengths of the requests finished since the last decision.
    recent_output_lengths: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # KV tokens allocated to running requests (the sum of their kv_tokens, kept as they change).
    used_tokens: int = 0

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def free_tokens(self, profile: ReplicaProfile) -> int:
        return profile.kv_capacity_tokens - self.used_tokens

    def unclaimed_tokens(self, profile: ReplicaProfile) -> int:
        """Free KV less what the requests already waiting here will prefill into it."""
        return self.free_tokens(profile) - sum(r.to_prefill - r.prefilled for r in self.waiting)

    def _preempt_newest(self) -> int:
        """Preempts the newest running request back to the front of the waiting queue; returns the
        tokens it freed."""
        victim = self.running.pop()
        freed, victim.kv_tokens, victim.prefilled = victim.kv_tokens, 0, 0
        victim.to_prefill = victim.spec.prompt_tokens + victim.generated
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.used_tokens -= freed
        self.waiting.appendleft(victim)
        return freed

    def _schedule(self, profile: ReplicaProfile) -> tuple[list[_Request], list[tuple[_Request, int]]]:
        """vLLM v1's scheduler: the requests that decode this step, and the prefill chunks it runs.

        Running requests first, in admission order: a decode takes one token, a prefill a chunk of the
        step's budget, and KV is allocated for exactly those tokens. When KV runs out, the newest running
        request is preempted (the one being scheduled, if it is the newest). Waiting requests are admitted
        only in a step that preempted nothing, while their next chunk fits the free KV.
        """
        budget, free = profile.max_num_batched_tokens, self.free_tokens(profile)
        decodes: list[_Request] = []
        chunks: list[tuple[_Request, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.to_prefill - request.prefilled
            tokens = min(remaining, budget) if remaining > 0 else 1
            while tokens > free and self.running[-1] is not request:
                free += self._preempt_newest()
                preempted = True
            if tokens > free:
                self._preempt_newest()
                preempted = True
                break
            if remaining > 0:
                chunks.append((request, tokens))
            else:
                decodes.append(request)
            free, budget, index = free - tokens, budget - tokens, index + 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < profile.max_num_seqs:
            request = self.waiting[0]
            tokens = min(request.to_prefill - request.prefilled, budget)
            if tokens > free:
                break
            self.running.append(self.waiting.popleft())
            chunks.append((request, tokens))
            free, budget = free - tokens, budget - tokens
        return decodes, chunks

    def step(self, profile: ReplicaProfile) -> float:
        """Runs one engine step from ``clock_s`` (schedule, run, postprocess); returns its duration."""
        decodes, chunks = self._schedule(profile)
        prefill_tokens = sum(tokens for _, tokens in chunks)
        duration = step_duration(profile, len(decodes), sum(r.kv_tokens for r in decodes), prefill_tokens)
        end = self.clock_s + duration
        self.recent_prompt_tokens += prefill_tokens
        self.used_tokens += prefill_tokens + len(decodes)
        advanced = list(decodes)  # requests that produced a token this step
        self.recent_generated_tokens += len(decodes)
        for request in decodes:
            request.kv_tokens += 1
            request.generated += 1
        for request, tokens in chunks:
            request.kv_tokens += tokens
            request.prefilled += tokens
            if request.prefilled >= request.to_prefill:  # the last chunk of a prefill yields the next token
                request.generated += 1
                self.recent_generated_tokens += 1
                advanced.append(request)
                if request.first_token_s is None:
                    request.first_token_s = end + profile.request_overhead_s
                    self.recent_ttfts.append(request.first_token_s - request.spec.arrival_s)
        for request in [r for r in advanced if r.generated >= r.spec.output_tokens]:
            request.finished_s = max(end, request.first_token_s or end)
            self.recent_output_lengths.append(request.generated)
            self.used_tokens -= request.kv_tokens
            self.running.remove(request)
        self.clock_s = end
        return duration


@dataclass
class TimelinePoint:
    """The pool at one decision."""

    time_s: float
    num_replicas: int  # including starting ones
    num_ready: int
    mean_kv_usage: float
    # Requests not running yet: in front of the pool or waiting inside an engine.
    num_queued: int
    num_running: int
    # Median TTFT of requests whose first token came since the previous point; None if none.
    ttft_s: float | None
    decision: Decision


@dataclass
class SimResult:
    """What a policy did on a trace."""

    policy: str
    num_requests: int
    ttft_attainment: float
    tpot_attainment: float
    replica_seconds: float
    ttfts: np.ndarray
    tpots: np.ndarray
    timeline: list[TimelinePoint]
    num_unfinished: int
    # Share of requests that met both targets (unfinished ones did not).
    slo_attainment: float
    # Times a replica ran out of KV and preempted a running request (which then recomputes).
    num_preemptions: int = 0
    # Each request's arrival time, and whether it met both targets (in the same order).
    arrivals_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    met_slo: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def miss_share(self, bins: np.ndarray) -> np.ndarray:
        """Share of the requests arriving in each window ``[bins[i], bins[i + 1])`` that missed a target; NaN
        for a window with no arrivals."""
        arrived, _ = np.histogram(self.arrivals_s, bins)
        missed, _ = np.histogram(self.arrivals_s[~self.met_slo], bins)
        return np.where(arrived > 0, missed / np.maximum(arrived, 1), math.nan)

    def summary(self) -> dict[str, float]:
        reasons: dict[str, int] = {}
        for point in self.timeline:
            reasons[point.decision.reason] = reasons.get(point.decision.reason, 0) + 1
        finite = self.ttfts[np.isfinite(self.ttfts)]
        return {"ttft_attainment": self.ttft_attainment, "tpot_attainment": self.tpot_attainment,
                "slo_attainment": self.slo_attainment, "replica_seconds": self.replica_seconds,
                "p50_ttft_s": float(np.median(finite)) if len(finite) else math.nan,
                "p99_ttft_s": float(np.percentile(finite, 99)) if len(finite) else math.nan,
                "max_replicas": max(p.num_replicas for p in self.timeline), "num_unfinished": self.num_unfinished,
                "num_preemptions": self.num_preemptions,
                **{f"decisions_{reason}": count for reason, count in sorted(reasons.items())}}


def simulate(trace: list[TraceRequest], policy: Policy, profile: ReplicaProfile = ReplicaProfile(),
             slo: SLO = SLO(), initial_replicas: int = 1, decision_interval_s: float = 1.0,
             tick_s: float = 0.05, drain_s: float = 120.0, name: str = "policy") -> SimResult:
    """Replays ``trace`` against a pool scaled by ``policy``; runs until every request finishes
    (or ``drain_s`` after the last arrival).

    Raises:
        ValueError: a request that could never fit one replica's KV capacity.
    """
    too_big = [r for r in trace if r.prompt_tokens + r.output_tokens > profile.kv_capacity_tokens]
    if too_big:
        raise ValueError(f"{len(too_big)} request(s) need more KV than one replica holds "
                         f"({too_big[0].prompt_tokens + too_big[0].output_tokens} > {profile.kv_capacity_tokens} tokens)")
    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    requests: list[_Request] = []
    queue: deque[_Request] = deque()
    replicas = [_Replica(ready_s=0.0, clock_s=0.0) for _ in range(initial_replicas)]
    timeline: list[TimelinePoint] = []
    replica_seconds = 0.0
    num_preemptions = 0
    next_decision = decision_interval_s
    last_arrival_s = max((r.arrival_s for r in trace), default=0.0)
    end_s = last_arrival_s + drain_s
    now = 0.0
    while now < end_s:
        now += tick_s
        while pending and pending[0].arrival_s <= now:
            request = _Request(pending.popleft())
            requests.append(request)
            queue.append(request)
        _route(queue, [r for r in replicas if r.ready_s <= now and not r.draining], profile)
        for replica in replicas:
            if replica.ready_s > now:
                continue
            replica.clock_s = max(replica.clock_s, replica.ready_s)
            while replica.clock_s < now:
                if replica.idle:
                    replica.clock_s = now
                    break
                replica.step(profile)
        replica_seconds += tick_s * len(replicas)
        replicas, num_preemptions = _retire(replicas, num_preemptions)
        if now + 1e-9 >= next_decision:
            next_decision += decision_interval_s
            timeline.append(_decide(policy, replicas, queue, now, profile, decision_interval_s))
            replicas, num_preemptions = _retire(_apply(timeline[-1].decision.desired_replicas, replicas, now, profile),
                                                num_preemptions)
        if not pending and not queue and now > last_arrival_s and all(r.idle for r in replicas):
            break
    num_preemptions += sum(r.num_preemptions for r in replicas)
    return _result(name, requests, slo, replica_seconds, timeline, num_preemptions)


def _retire(replicas: list[_Replica], num_preemptions: int) -> tuple[list[_Replica], int]:
    """Drops drained replicas that finished their work, adding their preemptions to the count."""
    done = [r for r in replicas if r.draining and r.idle]
    return [r for r in replicas if not (r.draining and r.idle)], num_preemptions + sum(r.num_preemptions for r in done)


def _route(queue: deque[_Request], ready: list[_Replica], profile: ReplicaProfile) -> None:
    """Sends queued requests, in order, to the ready replica with the most unclaimed KV, while it has room
    for the request's prompt and fewer than ``max_num_seqs`` requests; the rest wait in front of the pool
    (where a replica that starts later can take them)."""
    while queue and ready:
        target = max(ready, key=lambda r: r.unclaimed_tokens(profile))
        head = queue[0]
        if (target.unclaimed_tokens(profile) < head.to_prefill
                or len(target.running) + len(target.waiting) >= profile.max_num_seqs):
            return  # FCFS: the head waits for room rather than being overtaken
        if target.idle:  # an idle engine starts on the request when it arrives, not at the tick
            target.clock_s = max(target.clock_s, head.spec.arrival_s, target.ready_s)
        target.waiting.append(queue.popleft())


def _decide(policy: Policy, replicas: list[_Replica], queue: deque, now: float,
            profile: ReplicaProfile, interval_s: float) -> TimelinePoint:
    ready = [r for r in replicas if r.ready_s <= now and not r.draining]
    signals = []
    ttfts: list[float] = []
    for replica in ready:
        # As vLLM reports them: the KV allocated to running requests, and requests not scheduled yet.
        usage = replica.used_tokens / profile.kv_capacity_tokens
        pending = sum(r.spec.prompt_tokens for r in [*replica.running, *replica.waiting] if r.first_token_s is None)
        signals.append(ReplicaReport(kv_cache_usage=usage, num_waiting=len(replica.waiting),
                                      num_running=len(replica.running),
                                      prompt_tokens_per_s=replica.recent_prompt_tokens / interval_s,
                                      first_tokens_per_s=len(replica.recent_ttfts) / interval_s,
                                      tokens_per_s=(replica.recent_prompt_tokens
                                                    + replica.recent_generated_tokens) / interval_s,
                                      generated_tokens_per_s=replica.recent_generated_tokens / interval_s,
                                      num_pending_prompt_tokens=pending,
                                      ttft_s=fmean(replica.recent_ttfts) if replica.recent_ttfts else None,
                                      finished_per_s_by_length=tuple(
                                          count / interval_s for count in count_lengths(replica.recent_output_lengths))))
        ttfts += replica.recent_ttfts
        replica.recent_ttfts, replica.recent_prompt_tokens, replica.recent_generated_tokens = [], 0, 0
        replica.recent_output_lengths = []
    serving = [r for r in replicas if not r.draining]
    observation = PoolObservation(now, len(serving), tuple(signals), len(queue))
    decision = policy.decide(observation)
    return TimelinePoint(now, len(serving), len(ready), fmean(s.kv_cache_usage for s in signals) if signals else 0.0,
                         len(queue) + sum(len(r.waiting) for r in ready), sum(len(r.running) for r in ready),
                         float(np.median(ttfts)) if ttfts else None, decision)


def _apply(desired: int, replicas: list[_Replica], now: float, profile: ReplicaProfile) -> list[_Replica]:
    serving = [r for r in replicas if not r.draining]
    if desired > len(serving):
        for _ in range(desired - len(serving)):
            replicas.append(_Replica(ready_s=now + profile.startup_s, clock_s=now + profile.startup_s))
    elif desired < len(serving):
        # Remove replicas still starting first, then drain the least loaded ones.
        for replica in sorted(serving, key=lambda r: (r.ready_s <= now, len(r.running) + len(r.waiting)))[
                : len(serving) - desired]:
            replica.draining = True
    return replicas


def _result(name: str, requests: list[_Request], slo: SLO, replica_seconds: float,
            timeline: list[TimelinePoint], num_preemptions: int) -> SimResult:
    ttfts = np.array([r.first_token_s - r.spec.arrival_s if r.first_token_s is not None else math.inf
                      for r in requests])
    tpots = np.array([max(0.0, r.finished_s - r.first_token_s) / (r.spec.output_tokens - 1)
                      if r.finished_s is not None and r.spec.output_tokens > 1 else
                      (0.0 if r.finished_s is not None else math.inf) for r in requests])
    n = max(1, len(requests))
    ttft_ok, tpot_ok = ttfts <= slo.ttft_s, tpots <= slo.tpot_s
    return SimResult(name, len(requests), float(ttft_ok.sum() / n), float(tpot_ok.sum() / n), replica_seconds,
                     ttfts, tpots, timeline, sum(r.finished_s is None for r in requests),
                     float((ttft_ok & tpot_ok).sum() / n), num_preemptions,
                     np.array([r.spec.arrival_s for r in requests]), ttft_ok & tpot_ok)
