"""A trace-driven simulator of one autoscaled pool, for tuning policies before production.

Each replica is an engine with a KV capacity in tokens, a prefill speed and a decode step time that
grows with the batch (a measured ``ReplicaProfile``), and a start-up delay. Requests arrive, queue in
front of the pool, are admitted to the replica with the most free KV when their whole context fits,
prefill in chunks alongside running decodes (vLLM's chunked prefill: decodes first, then prefill
tokens up to the step budget), decode one token per step, and free their KV. Replicas advance step
by step on their own clocks; the policy is asked every ``decision_interval_s`` with the same signals
real replicas report (KV usage, running, recent TTFT, prompt tokens computed and the prefill backlog) plus
the queue.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import fmean

import numpy as np

from fleetserve.autoscaler.policy import Decision, Policy, PoolObservation, ReplicaSignals
from fleetserve.autoscaler.traces import TraceRequest


@dataclass(frozen=True)
class ReplicaProfile:
    """What one replica does, measured on real hardware (see benchmarks/autoscaling.py)."""

    # KV-cache capacity in tokens (KV bytes / KV bytes per token).
    kv_capacity_tokens: int = 16384
    # Prompt tokens prefilled per second when prefill has the engine to itself.
    prefill_tokens_per_s: float = 4000.0
    # One decode step takes decode_step_base_s + decode_step_per_seq_s * batch.
    decode_step_base_s: float = 0.010
    decode_step_per_seq_s: float = 0.001
    # Most sequences running at once (max_num_seqs) and tokens per step (max_num_batched_tokens).
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Seconds from "add a replica" to serving (process start, weight load, warm-up).
    startup_s: float = 30.0
    # Fixed latency each request's first token carries beyond engine steps (API, IPC, scheduling).
    request_overhead_s: float = 0.0


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet to count as served well."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


@dataclass
class _Request:
    spec: TraceRequest
    prefilled: int = 0
    generated: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def context(self) -> int:
        return self.spec.prompt_tokens + self.spec.output_tokens


@dataclass
class _Replica:
    ready_s: float
    clock_s: float
    draining: bool = False
    running: list[_Request] = field(default_factory=list)
    recent_ttfts: list[float] = field(default_factory=list)
    # Prompt tokens prefilled since the last decision (what the engine reports as computed).
    recent_prompt_tokens: int = 0

    @property
    def reserved_tokens(self) -> int:
        return sum(r.context for r in self.running)

    def free_tokens(self, profile: ReplicaProfile) -> int:
        return profile.kv_capacity_tokens - self.reserved_tokens

    def step(self, profile: ReplicaProfile) -> float:
        """Runs one engine step from ``clock_s``; returns its duration."""
        decoding = [r for r in self.running if r.prefilled == r.spec.prompt_tokens]
        budget = profile.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[_Request, int]] = []
        for request in self.running:
            if budget <= 0:
                break
            remaining = request.spec.prompt_tokens - request.prefilled
            if remaining > 0:
                chunk = min(remaining, budget)
                chunks.append((request, chunk))
                budget -= chunk
        prefill_tokens = sum(chunk for _, chunk in chunks)
        duration = (profile.decode_step_base_s + profile.decode_step_per_seq_s * len(decoding)
                    + prefill_tokens / profile.prefill_tokens_per_s)
        end = self.clock_s + duration
        for request in decoding:
            request.generated += 1
        self.recent_prompt_tokens += prefill_tokens
        for request, chunk in chunks:
            request.prefilled += chunk
            if request.prefilled == request.spec.prompt_tokens:  # the first token comes with the last chunk
                request.generated = 1
                request.first_token_s = end + profile.request_overhead_s
                self.recent_ttfts.append(request.first_token_s - request.spec.arrival_s)
        for request in [r for r in self.running if r.generated >= r.spec.output_tokens]:
            request.finished_s = max(end, request.first_token_s or end)
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
        ready = [r for r in replicas if r.ready_s <= now and not r.draining]
        while queue and ready:
            target = max(ready, key=lambda r: r.free_tokens(profile))
            head = queue[0]
            if target.free_tokens(profile) < head.context or len(target.running) >= profile.max_num_seqs:
                break  # FCFS: the head waits for room rather than being overtaken
            if not target.running:  # an idle engine starts on the request when it arrives, not at the tick
                target.clock_s = max(target.clock_s, head.spec.arrival_s, target.ready_s)
            target.running.append(queue.popleft())
        for replica in replicas:
            if replica.ready_s > now:
                continue
            replica.clock_s = max(replica.clock_s, replica.ready_s)
            while replica.clock_s < now:
                if not replica.running:
                    replica.clock_s = now
                    break
                replica.step(profile)
        replica_seconds += tick_s * len(replicas)
        replicas = [r for r in replicas if not (r.draining and not r.running)]
        if now + 1e-9 >= next_decision:
            next_decision += decision_interval_s
            timeline.append(_decide(policy, replicas, queue, now, profile, decision_interval_s))
            replicas = _apply(timeline[-1].decision.desired_replicas, replicas, now, profile)
        if not pending and not queue and now > last_arrival_s and all(not r.running for r in replicas):
            break
    return _result(name, requests, slo, replica_seconds, timeline)


def _decide(policy: Policy, replicas: list[_Replica], queue: deque, now: float,
            profile: ReplicaProfile, interval_s: float) -> TimelinePoint:
    ready = [r for r in replicas if r.ready_s <= now and not r.draining]
    signals = []
    ttfts: list[float] = []
    for replica in ready:
        # As vLLM reports them: KV blocks hold the tokens computed so far; a request whose prefill has
        # not started is still waiting.
        usage = sum(r.prefilled + r.generated for r in replica.running) / profile.kv_capacity_tokens
        waiting = sum(1 for r in replica.running if r.prefilled == 0)
        pending = sum(r.spec.prompt_tokens for r in replica.running if r.first_token_s is None)
        signals.append(ReplicaSignals(kv_cache_usage=usage, num_waiting=waiting,
                                      num_running=len(replica.running) - waiting,
                                      prompt_tokens_per_s=replica.recent_prompt_tokens / interval_s,
                                      num_pending_prompt_tokens=pending,
                                      ttft_s=fmean(replica.recent_ttfts) if replica.recent_ttfts else None))
        ttfts += replica.recent_ttfts
        replica.recent_ttfts, replica.recent_prompt_tokens = [], 0
    serving = [r for r in replicas if not r.draining]
    observation = PoolObservation(now, len(serving), tuple(signals), len(queue))
    decision = policy.decide(observation)
    return TimelinePoint(now, len(serving), len(ready), fmean(s.kv_cache_usage for s in signals) if signals else 0.0,
                         len(queue), sum(len(r.running) for r in ready),
                         float(np.median(ttfts)) if ttfts else None, decision)


def _apply(desired: int, replicas: list[_Replica], now: float, profile: ReplicaProfile) -> list[_Replica]:
    serving = [r for r in replicas if not r.draining]
    if desired > len(serving):
        for _ in range(desired - len(serving)):
            replicas.append(_Replica(ready_s=now + profile.startup_s, clock_s=now + profile.startup_s))
    elif desired < len(serving):
        # Remove replicas still starting first, then drain the least loaded ones.
        for replica in sorted(serving, key=lambda r: (r.ready_s <= now, len(r.running)))[: len(serving) - desired]:
            replica.draining = True
    return [r for r in replicas if not (r.draining and not r.running)]


def _result(name: str, requests: list[_Request], slo: SLO, replica_seconds: float,
            timeline: list[TimelinePoint]) -> SimResult:
    ttfts = np.array([r.first_token_s - r.spec.arrival_s if r.first_token_s is not None else math.inf
                      for r in requests])
    tpots = np.array([max(0.0, r.finished_s - r.first_token_s) / (r.spec.output_tokens - 1)
                      if r.finished_s is not None and r.spec.output_tokens > 1 else
                      (0.0 if r.finished_s is not None else math.inf) for r in requests])
    n = max(1, len(requests))
    ttft_ok, tpot_ok = ttfts <= slo.ttft_s, tpots <= slo.tpot_s
    return SimResult(name, len(requests), float(ttft_ok.sum() / n), float(tpot_ok.sum() / n), replica_seconds,
                     ttfts, tpots, timeline, sum(r.finished_s is None for r in requests),
                     float((ttft_ok & tpot_ok).sum() / n))
