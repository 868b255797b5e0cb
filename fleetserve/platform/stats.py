"""Engine stats taken from vLLM's own scheduler, through a stat logger.

vLLM calls ``record`` about once per engine step, in the process that owns the AsyncLLM. The
scheduler's gauges (running, waiting, KV usage) are replaced each step; its cache and token counts
arrive as per-step deltas, so they are accumulated here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

from fleetserve.platform.output_lengths import NUM_OUTPUT_LENGTH_BUCKETS, count_lengths


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine, as its scheduler last reported it."""

    # Fraction of KV-cache blocks in use, 0-1; cached-but-unreferenced prefix blocks count as free.
    kv_cache_usage: float = 0.0
    # Requests scheduled in the last step.
    num_running: int = 0
    # Requests queued for their first schedule.
    num_waiting: int = 0
    # Prompt tokens looked up in the prefix cache, and how many of them hit (cumulative).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Requests preempted for lack of KV blocks (cumulative).
    num_preemptions: int = 0
    # Prompt tokens prefilled and tokens generated (cumulative).
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Prompt tokens this engine computed itself, and those whose KV arrived from a peer engine
    # (disaggregated prefill) (cumulative).
    num_computed_prompt_tokens: int = 0
    num_external_prompt_tokens: int = 0
    # Requests that ran to a stop condition or max_tokens (cumulative); vLLM leaves aborted ones out.
    num_finished: int = 0
    # Of those, how many generated a number of tokens in each bucket of OUTPUT_LENGTH_EDGES (cumulative).
    output_length_counts: tuple[int, ...] = (0,) * NUM_OUTPUT_LENGTH_BUCKETS
    # Time to first token, summed over requests that got one, and how many did (cumulative).
    ttft_sum_s: float = 0.0
    num_first_tokens: int = 0
    # Engine steps recorded so far; 0 means the engine has not reported yet.
    num_steps: int = 0
    # Wall-clock time of the last report (time.time()).
    updated_at: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hits over queries; None before any query."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


class StatsListener(Protocol):
    """Anything else that wants each engine step's raw stats (e.g. Prometheus metrics)."""

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None: ...


class StatsRecorder:
    """Accumulates vLLM scheduler and iteration stats into ``EngineStats`` snapshots."""

    def __init__(self, listeners: Sequence[StatsListener] = ()) -> None:
        self._snapshot = EngineStats()
        self._listeners = list(listeners)

    def snapshot(self) -> EngineStats:
        return self._snapshot

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Folds one engine step's stats in. Arguments are vLLM's SchedulerStats / IterationStats."""
        current = self._snapshot
        fields = dict(current.__dict__)
        if scheduler_stats is not None:
            fields["kv_cache_usage"] = float(scheduler_stats.kv_cache_usage)
            fields["num_running"] = int(scheduler_stats.num_running_reqs)
            fields["num_waiting"] = int(scheduler_stats.num_waiting_reqs)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                fields["prefix_cache_queries"] += int(prefix.queries)
                fields["prefix_cache_hits"] += int(prefix.hits)
        if iteration_stats is not None:
            fields["num_preemptions"] += int(iteration_stats.num_preempted_reqs)
            fields["num_prompt_tokens"] += int(iteration_stats.num_prompt_tokens)
            fields["num_generation_tokens"] += int(iteration_stats.num_generation_tokens)
            fields["num_finished"] += len(iteration_stats.finished_requests)
            if iteration_stats.finished_requests:
                finished = count_lengths([f.num_generation_tokens for f in iteration_stats.finished_requests])
                fields["output_length_counts"] = tuple(map(sum, zip(current.output_length_counts, finished)))
            prompt_stats = getattr(iteration_stats, "prompt_token_stats", None)
            if prompt_stats is not None:
                fields["num_computed_prompt_tokens"] += int(prompt_stats.computed)
                fields["num_external_prompt_tokens"] += int(prompt_stats.external_kv_transfer)
            ttfts = iteration_stats.time_to_first_tokens_iter
            fields["ttft_sum_s"] += float(sum(ttfts))
            fields["num_first_tokens"] += len(ttfts)
        fields["num_steps"] += 1
        fields["updated_at"] = time.time()
        self._snapshot = EngineStats(**fields)
        for listener in self._listeners:
            listener.record(scheduler_stats, iteration_stats)

    def stat_logger_factory(self):
        """A per-engine stat-logger factory for ``AsyncLLM(stat_loggers=[...])`` feeding this recorder."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class _RecorderLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                recorder.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _RecorderLogger
