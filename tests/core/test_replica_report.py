"""The per-replica report: rates computed once, by the reporter, and carried intact through both Serve
boundaries (the autoscaler's metrics and the router's stats)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats

from fleetserve.autoscaler.serve_adapter import _reports, autoscaling_metrics
from fleetserve.platform.output_lengths import NUM_OUTPUT_LENGTH_BUCKETS, bucket_index
from fleetserve.platform.replica_report import ReplicaReport, ReplicaReporter
from fleetserve.platform.stats import EngineStats, StatsRecorder
from fleetserve.router.replica.serve_adapter import KVEventSource, RoutingStats, routing_stats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(**fields) -> EngineStats:
    return EngineStats(**{"kv_cache_usage": 0.5, "num_running": 3, "num_waiting": 1, **fields})


def test_first_report_has_no_rates_then_rates_cover_the_interval():
    clock = FakeClock()
    reporter = ReplicaReporter("r0", "decode", clock)
    first = reporter.report(stats(num_prompt_tokens=100, num_generation_tokens=50), num_pending_prompt_tokens=7,
                            max_num_seqs=256)
    assert (first.tokens_per_s, first.prompt_tokens_per_s, first.ttft_s) == (0.0, 0.0, None)
    assert (first.replica_id, first.pool, first.num_pending_prompt_tokens) == ("r0", "decode", 7)
    assert first.max_num_seqs == 256
    clock.now += 2.0
    second = reporter.report(stats(num_prompt_tokens=300, num_generation_tokens=90, num_computed_prompt_tokens=120,
                                   ttft_sum_s=1.5, num_first_tokens=3, num_finished=4), num_pending_prompt_tokens=0)
    # (300 + 90 - 100 - 50) / 2 s = 120 tokens/s; 120 computed / 2 s = 60; 1.5 s over 3 first tokens = 0.5 s.
    assert (second.tokens_per_s, second.prompt_tokens_per_s, second.ttft_s) == (120.0, 60.0, 0.5)
    # (90 - 50) / 2 s = 20 generated tokens/s; 3 first tokens / 2 s = 1.5/s.
    assert (second.generated_tokens_per_s, second.first_tokens_per_s) == (20.0, 1.5)
    assert (second.num_finished, second.kv_cache_usage, second.num_running, second.num_waiting) == (4, 0.5, 3, 1)


def finished(*num_generation_tokens: int) -> IterationStats:
    iteration = IterationStats()
    iteration.finished_requests = [FinishedRequestStats(finish_reason="stop", num_generation_tokens=n)
                                   for n in num_generation_tokens]
    return iteration


def test_the_recorder_counts_finished_requests_by_output_length():
    recorder = StatsRecorder()
    recorder.record(None, finished(7, 7, 300))
    recorder.record(None, finished(9))
    counts = recorder.snapshot().output_length_counts
    # 7 and 7 in [6, 8), 9 in [8, 11), 300 in [256, 362); nothing else.
    assert (counts[bucket_index(7)], counts[bucket_index(9)], counts[bucket_index(300)], sum(counts)) == (2, 1, 1, 4)
    assert recorder.snapshot().num_finished == 4


def test_finished_requests_by_length_are_rates_over_the_interval():
    clock = FakeClock()
    reporter = ReplicaReporter("r0", "colocated", clock)
    before = [0] * NUM_OUTPUT_LENGTH_BUCKETS
    assert reporter.report(stats(output_length_counts=tuple(before)), 0).finished_per_s_by_length == ()
    after = list(before)
    after[bucket_index(7)], after[bucket_index(300)] = 4, 1
    clock.now += 2.0
    rates = reporter.report(stats(output_length_counts=tuple(after)), 0).finished_per_s_by_length
    # 4 and 1 finished over 2 s: 2/s and 0.5/s.
    assert (rates[bucket_index(7)], rates[bucket_index(300)], sum(rates)) == (2.0, 0.5, 2.5)


def test_an_interval_without_first_tokens_reports_no_ttft():
    clock = FakeClock()
    reporter = ReplicaReporter("r0", "colocated", clock)
    reporter.report(stats(ttft_sum_s=1.0, num_first_tokens=2), 0)
    clock.now += 1.0
    assert reporter.report(stats(ttft_sum_s=1.0, num_first_tokens=2), 0).ttft_s is None


@dataclass(frozen=True)
class ReplicaID:
    unique_id: str


def test_a_report_survives_serves_autoscaling_metrics():
    report = ReplicaReport(replica_id="r0", pool="prefill", kv_cache_usage=0.25, num_running=2, num_waiting=5,
                           num_pending_prompt_tokens=640, tokens_per_s=80.0, prompt_tokens_per_s=40.0, ttft_s=0.3,
                           generated_tokens_per_s=40.0, first_tokens_per_s=2.0,
                           finished_per_s_by_length=tuple(float(i) for i in range(NUM_OUTPUT_LENGTH_BUCKETS)))
    metrics = autoscaling_metrics(report)
    # Serve keeps {metric: {replica: value}}; num_finished is admission control's, not the autoscaler's.
    aggregated = {name: {ReplicaID("r0"): value} for name, value in metrics.items()}
    assert _reports(aggregated, [ReplicaID("r0"), ReplicaID("starting")], "prefill") == (report,)
    assert "ttft_s" not in autoscaling_metrics(ReplicaReport(kv_cache_usage=0.1))


@dataclass
class Replica:
    routing_stats: dict | None


def test_a_report_survives_serves_routing_stats():
    report = ReplicaReport(kv_cache_usage=0.75, num_running=1)
    events = KVEventSource("tcp://127.0.0.1:5557", 16)
    read = RoutingStats.of(Replica(routing_stats(report, events)))
    assert (read.kv_cache_usage, read.kv_events) == (0.75, events)
    assert RoutingStats.of(Replica(None)) == RoutingStats(None, None)
