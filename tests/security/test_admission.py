"""Admission control's rule on hand-built engine reports (pure; no engine, no Ray)."""

from __future__ import annotations

import pytest

from fleetserve.deployments.ingress.admission import AdmissionController
from fleetserve.platform.replica_report import ReplicaReport
from fleetserve.platform.config import LimitsConfig, ModelConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(replicas: int = 1, max_num_seqs: int = 4, **limits) -> tuple[AdmissionController, Clock]:
    model = ModelConfig(name="m", source="unused", replicas=replicas, engine_args={"max_num_seqs": max_num_seqs})
    clock = Clock()
    limits = {"min_queued_per_replica": 2, "max_queue_wait_s": 4.0, **limits}
    return AdmissionController(model, LimitsConfig(**limits), clock), clock


def load(replica_id: str = "a", pool: str = "colocated", **stats) -> ReplicaReport:
    return ReplicaReport(replica_id=replica_id, pool=pool, **stats)


def test_queue_bound_is_what_the_engines_drain_within_max_wait():
    admission, clock = controller(max_num_seqs=16)
    admission.observe([load(num_finished=0)])
    clock.now = 10.0
    admission.observe([load(num_running=8, num_waiting=10, kv_cache_usage=0.95, num_finished=50)])
    # 50 finished in 10 s = 5/s; 5/s x 4 s = 20 may queue. KV is saturated, so no headroom:
    # 19 admitted here without a first token + this one = 20 queued (more than the engine's 10 + 1 waiting,
    # and than 30 + 1 in flight - 16 slots = 15).
    assert admission.completion_rate() == 5.0
    decision = admission.decide(30, 19)
    assert (decision.admitted, decision.num_queued, decision.queue_allowance) == (True, 20, 20)
    # One more unstarted: 21 queued, 1 over; at 5/s it drains in ceil(1 / 5) = 1 s. Requests already
    # streaming within the engines' slots (the other 11 in flight) do not count as queued.
    decision = admission.decide(30, 20)
    assert (decision.admitted, decision.num_queued, decision.retry_after_s) == (False, 21, 1)


def test_engine_waiting_counts_even_when_this_ingress_holds_little():
    admission, _ = controller()
    # Another ingress filled the engine: 30 waiting, nothing rate-measured yet (floor 2 x 1 replica = 2).
    admission.observe([load(num_running=4, num_waiting=30, kv_cache_usage=0.5)])
    decision = admission.decide(0)
    # max(30 + 1, 1 - 4) = 31 queued > 2; no completion rate yet, so retry after the minimum, 1 s.
    assert (decision.admitted, decision.num_queued, decision.queue_allowance, decision.retry_after_s) == (
        False, 31, 2, 1)


def test_free_engine_slots_absorb_a_burst_before_the_queue_bound():
    admission, _ = controller(replicas=2, max_num_seqs=4)
    admission.observe([load("a", num_running=6, kv_cache_usage=0.5), load("b", num_running=2, kv_cache_usage=0.3)])
    # Nothing waits and KV has room. The engines last reported 8 running, but of the 11 requests here only
    # 3 stream now (11 - 8 unstarted): headroom = 4 x 2 - 3 = 5 slots start at once; floor = 2 x 2 = 4.
    # 8 unstarted + 1 = 9; 9 - 5 headroom = 4 queued <= 4.
    assert admission.decide(11, 8).admitted
    assert not admission.decide(12, 9).admitted  # 3 streaming still: 10 - 5 = 5 queued > 4


def test_engines_own_max_num_seqs_sizes_the_slots_where_the_config_leaves_it():
    model = ModelConfig(name="m", source="unused", replicas=2)  # max_num_seqs left to vLLM
    admission = AdmissionController(model, LimitsConfig(min_queued_per_replica=2, max_queue_wait_s=4.0), Clock())
    assert admission.num_slots() == 128  # before any report: one replica at vLLM's least default
    admission.observe([load("a", max_num_seqs=1024, kv_cache_usage=0.1),
                       load("b", max_num_seqs=1024, kv_cache_usage=0.1)])
    # vLLM chose 1024 per engine (an H100 API server's default): 2 x 1024 = 2,048 slots, all free, so 2,000
    # unstarted requests + 1 queue nothing beyond the engines' 0 + 1 waiting: admitted. At 128 slots per engine
    # (256) the same request would count 2,001 - 256 = 1,745 queued against a floor of 2 x 2 = 4.
    assert admission.num_slots() == 2048
    assert admission.decide(2000, 2000).admitted
    # A replica that has not said (0) counts at the fallback: 1,024 + 128.
    admission.observe([load("a", max_num_seqs=1024, kv_cache_usage=0.1), load("b", kv_cache_usage=0.1)])
    assert admission.num_slots() == 1152


def test_requests_beyond_all_engine_slots_count_as_queued():
    admission, _ = controller(replicas=2, max_num_seqs=4)
    admission.observe([load("a", num_running=4, kv_cache_usage=0.5), load("b", num_running=4, kv_cache_usage=0.5)])
    # All 4 x 2 = 8 slots run and nothing is unstarted, but output backs up on the way to clients:
    # 12 in flight + 1 - 8 slots = 5 queued > the floor of 2 x 2 = 4.
    decision = admission.decide(12, 0)
    assert (decision.admitted, decision.num_queued) == (False, 5)
    assert admission.decide(11, 0).admitted  # 4 queued


def test_saturated_kv_leaves_no_headroom():
    admission, _ = controller(max_num_seqs=4)
    admission.observe([load(num_running=1, kv_cache_usage=0.92)])
    # KV at 0.92 >= 0.9: the engine cannot start more, so 2 unstarted + 1 = 3 queued > 2.
    assert not admission.decide(3, 2).admitted
    assert admission.decide(3, 1).admitted  # 2 queued


def test_retry_after_is_the_time_to_drain_the_excess_capped():
    admission, clock = controller(max_queue_wait_s=10.0)
    admission.observe([load(num_finished=0)])
    clock.now = 10.0
    admission.observe([load(num_running=1, num_waiting=0, kv_cache_usage=0.95, num_finished=5)])
    # 0.5/s x 10 s = 5 may queue; 14 unstarted + 1 = 15 queued, 10 over: ceil(10 / 0.5) = 20 s.
    assert admission.decide(15, 14).retry_after_s == 20
    # 200 over would be 400 s; capped at 60.
    assert admission.decide(300, 204).retry_after_s == 60


def test_restarted_replica_counter_is_not_a_burst_of_completions():
    admission, clock = controller()
    admission.observe([load("a", num_finished=100)])
    clock.now = 5.0
    # Replica a died; b started with its own counter at 500. Neither spans the window: rate 0.
    admission.observe([load("b", num_finished=500)])
    assert admission.completion_rate() == 0.0


def test_rate_window_slides():
    admission, clock = controller()
    for second, finished in [(0, 0), (5, 100), (10, 110), (15, 120)]:
        clock.now = float(second)
        admission.observe([load(num_finished=finished)])
    # The 100 finished in the first 5 s fell out of the 10 s window: (120 - 100) / (15 - 5) = 2/s.
    assert admission.completion_rate() == 2.0


def test_in_flight_ceiling_applies_without_engine_reports():
    admission, _ = controller(replicas=2, max_in_flight_per_replica=3)
    # No report yet: only the hard bound, 3 x 2 replicas = 6.
    assert admission.decide(5).admitted and admission.decide(5).queue_allowance is None
    refused = admission.decide(6)
    assert (refused.admitted, refused.in_flight_bound, refused.retry_after_s) == (False, 6, 1)
    error = admission.refusal("m", refused)
    assert (error.status_code, error.code, error.headers) == (503, "overloaded", {"Retry-After": "1"})


def test_prefill_queue_counts_but_only_decode_replicas_serve():
    model = ModelConfig.model_validate({"name": "pd", "source": "unused", "engine_args": {"max_num_seqs": 4},
                                        "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}})
    admission = AdmissionController(model, LimitsConfig(min_queued_per_replica=2, max_queue_wait_s=4.0))
    admission.observe([load("p", "prefill", num_running=1, num_waiting=3, kv_cache_usage=0.1),
                       load("d", "decode", num_running=2, kv_cache_usage=0.2)])
    # Serving replicas: decode only (1), floor 2. 3 wait for prefill, so there is no headroom:
    # max(3 + 1, 0 + 1 - 2) = 4 queued > 2.
    decision = admission.decide(0)
    assert (decision.admitted, decision.num_queued, decision.queue_allowance) == (False, 4, 2)


@pytest.mark.parametrize("limits", [{"max_queue_wait_s": None}, {}])
def test_queue_bound_off_or_without_reports_admits(limits):
    admission, _ = controller(**limits)
    if limits:
        admission.observe([load(num_waiting=100)])
    assert admission.decide(50).admitted


def test_the_in_flight_bound_is_split_over_the_ingress_replicas():
    model = ModelConfig(name="m", source="unused", replicas=3, engine_args={"max_num_seqs": 4})
    admission = AdmissionController(model, LimitsConfig(max_in_flight_per_replica=5, max_queue_wait_s=None),
                                    num_parts=2)
    # 5 per serving replica x 3 replicas = 15, over 2 ingress replicas: ceil(7.5) = 8 here.
    assert admission.decide(num_in_flight=7).admitted
    decision = admission.decide(num_in_flight=8)
    assert (decision.admitted, decision.in_flight_bound) == (False, 8)
