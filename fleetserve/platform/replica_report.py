"""The one record an engine replica reports about itself, read by the replica router, the autoscaler and
admission control; and the reporter that computes its rates, in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fleetserve.platform.stats import EngineStats


@dataclass(frozen=True)
class ReplicaReport:
    """One engine replica now, and its rates since its previous report to the same reader."""

    # The Serve replica that reports (its unique id), and its pool: colocated, prefill or decode.
    replica_id: str = ""
    pool: str = "colocated"
    # Fraction of KV-cache blocks in use, 0-1; cached-but-unreferenced prefix blocks count as free.
    kv_cache_usage: float = 0.0
    # Requests the engine is running, and those queued inside it for their first schedule.
    num_running: int = 0
    num_waiting: int = 0
    # Prompt tokens of requests on this replica with no first token yet: its prefill backlog (a prompt
    # whose KV a prefill replica computes is not this replica's backlog).
    num_pending_prompt_tokens: int = 0
    # Requests the engine has run to completion since it started (admission control's drain rate).
    num_finished: int = 0
    # Prompt plus generated tokens per second since the previous report, and generated tokens alone.
    tokens_per_s: float = 0.0
    generated_tokens_per_s: float = 0.0
    # Prompt tokens the engine computed itself per second since the previous report (prefix-cache hits
    # and KV received from a prefill replica excluded: no work here).
    prompt_tokens_per_s: float = 0.0
    # Requests that got their first token, per second since the previous report (with prompt_tokens_per_s,
    # the mean prompt a request brings).
    first_tokens_per_s: float = 0.0
    # Mean time to first token of requests that got one since the previous report; None when none did.
    ttft_s: float | None = None
    # Requests finished per second since the previous report, by the bucket of OUTPUT_LENGTH_EDGES their
    # output fell in (empty on the first report): the distribution a TPOT miss depends on.
    finished_per_s_by_length: tuple[float, ...] = ()
    # Requests the engine runs at once (its max_num_seqs, as vLLM chose it where the config leaves it); 0 where
    # not known (simulated replicas).
    max_num_seqs: int = 0


class ReplicaReporter:
    """Builds a replica's reports from its engine's cumulative stats; rates cover the interval since this
    reporter's previous report (each reader keeps its own reporter, since each reads at its own period).

    Args:
        replica_id: the reporting replica.
        pool: its pool.
        clock: monotonic seconds.
    """

    def __init__(self, replica_id: str, pool: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id = replica_id
        self.pool = pool
        self.clock = clock
        # (time, stats) at the previous report.
        self._previous: tuple[float, EngineStats] | None = None

    def report(self, stats: EngineStats, num_pending_prompt_tokens: int, max_num_seqs: int = 0) -> ReplicaReport:
        """The replica now; its rates are 0 (and its TTFT None) on the first report."""
        now = self.clock()
        previous, self._previous = self._previous, (now, stats)
        rates: dict[str, float | tuple[float, ...] | None] = {}
        if previous is not None and now > previous[0]:
            before, seconds = previous[1], now - previous[0]
            tokens = (stats.num_prompt_tokens + stats.num_generation_tokens
                      - before.num_prompt_tokens - before.num_generation_tokens)
            firsts = stats.num_first_tokens - before.num_first_tokens
            rates = {"tokens_per_s": tokens / seconds,
                     "generated_tokens_per_s": (stats.num_generation_tokens - before.num_generation_tokens) / seconds,
                     "prompt_tokens_per_s": (stats.num_computed_prompt_tokens - before.num_computed_prompt_tokens) / seconds,
                     "first_tokens_per_s": firsts / seconds,
                     "ttft_s": (stats.ttft_sum_s - before.ttft_sum_s) / firsts if firsts > 0 else None,
                     "finished_per_s_by_length": tuple((now_count - then) / seconds for now_count, then
                                                       in zip(stats.output_length_counts, before.output_length_counts))}
        return ReplicaReport(replica_id=self.replica_id, pool=self.pool, kv_cache_usage=stats.kv_cache_usage,
                             num_running=stats.num_running, num_waiting=stats.num_waiting,
                             num_pending_prompt_tokens=num_pending_prompt_tokens, num_finished=stats.num_finished,
                             max_num_seqs=max_num_seqs, **rates)
