"""The per-replica report: rates computed once, by the reporter, and carried intact through both Serve
boundaries (the autoscaler's metrics and the router's stats)."""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.autoscaler.serve_adapter import _reports, autoscaling_metrics
from fleetserve.platform.replica_report import ReplicaReport, ReplicaReporter
from fleetserve.platform.stats import EngineStats
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
    first = reporter.report(stats(num_prompt_tokens=100, num_generation_tokens=50), num_pending_prompt_tokens=7)
    assert (first.tokens_per_s, first.prompt_tokens_per_s, first.ttft_s) == (0.0, 0.0, None)
    assert (first.replica_id, first.pool, first.num_pending_prompt_tokens) == ("r0", "decode", 7)
    clock.now += 2.0
    second = reporter.report(stats(num_prompt_tokens=300, num_generation_tokens=90, num_computed_prompt_tokens=120,
                                   ttft_sum_s=1.5, num_first_tokens=3, num_finished=4), num_pending_prompt_tokens=0)
    # (300 + 90 - 100 - 50) / 2 s = 120 tokens/s; 120 computed / 2 s = 60; 1.5 s over 3 first tokens = 0.5 s.
    assert (second.tokens_per_s, second.prompt_tokens_per_s, second.ttft_s) == (120.0, 60.0, 0.5)
    # (90 - 50) / 2 s = 20 generated tokens/s; 3 first tokens / 2 s = 1.5/s.
    assert (second.generated_tokens_per_s, second.first_tokens_per_s) == (20.0, 1.5)
    assert (second.num_finished, second.kv_cache_usage, second.num_running, second.num_waiting) == (4, 0.5, 3, 1)


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
                           generated_tokens_per_s=40.0, first_tokens_per_s=2.0)
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
