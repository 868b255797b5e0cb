"""The SLO-driven policy: thresholds derived from the SLOs and the profile, the forecast, and the sizing,
each with the arithmetic in comments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleetserve.autoscaler.policies import make_policy
from fleetserve.autoscaler.policy import PoolObservation
from fleetserve.autoscaler.slo_policy import (
    Demand,
    SLOPolicy,
    forecast,
    miss_shares,
    tpot_miss_given_output,
    tpot_miss_share,
    ttft_miss_share,
)
from fleetserve.platform.config import AutoscalingConfig, ConfigError, ReplicaProfile, parse_section
from fleetserve.platform.output_lengths import NUM_OUTPUT_LENGTH_BUCKETS, bucket_index
from fleetserve.platform.replica_report import ReplicaReport

PROFILE = ReplicaProfile(kv_capacity_tokens=10_000, prefill_tokens_per_s=1000, decode_step_base_s=0.01,
                         decode_step_per_seq_s=0.001, max_num_seqs=64, startup_s=10)


def slo_policy(**knobs) -> SLOPolicy:
    """TTFT p99 2 s, TPOT p99 50 ms, PROFILE, 1-8 replicas unless given."""
    given = {"policy": "slo", "ttft_p99_s": 2.0, "tpot_p99_s": 0.05, "profile": PROFILE, "min_replicas": 1,
             "max_replicas": 8, **knobs}
    return SLOPolicy(AutoscalingConfig(**given))


def report(prompt_tokens_per_s: float = 0.0, firsts_per_s: float = 0.0, kv: float = 0.0, running: int = 0,
           waiting: int = 0, pending: int = 0, generated_per_s: float = 0.0,
           finished_per_s: dict[int, float] | None = None) -> ReplicaReport:
    """``finished_per_s``: requests finished per second by output length."""
    by_length = [0.0] * NUM_OUTPUT_LENGTH_BUCKETS
    for length, rate in (finished_per_s or {}).items():
        by_length[bucket_index(length)] += rate
    return ReplicaReport(kv_cache_usage=kv, num_running=running, num_waiting=waiting,
                         num_pending_prompt_tokens=pending, prompt_tokens_per_s=prompt_tokens_per_s,
                         first_tokens_per_s=firsts_per_s, generated_tokens_per_s=generated_per_s,
                         finished_per_s_by_length=tuple(by_length) if finished_per_s else ())


def shares(lengths: dict[int, float]) -> tuple[float, ...]:
    """Shares by output-length bucket, from {output length: share}."""
    return report(finished_per_s=lengths).finished_per_s_by_length


def test_ttft_miss_share_is_an_mm1_queues_time_in_system():
    # Exponential with rate (1 - 0.5) / 0.1 = 5/s: P(> 2 s) = exp(-10) = 4.54e-5.
    assert ttft_miss_share(0.5, 0.1, 2.0) == pytest.approx(math.exp(-10))
    assert ttft_miss_share(1.0, 0.1, 2.0) == 1.0


def test_tpot_miss_given_output_counts_the_prefills_a_request_lives_through():
    # 11 tokens at 0.02 s steps with half the replica's time prefilling: 11 x 0.02 / 0.5 = 0.44 s of life,
    # 5 prompts/s x 0.44 = 2.2 arriving on average. TPOT 50 ms leaves (0.05 - 0.02) x 10 = 0.3 s of stalls:
    # 3 prefills of 0.1 s. It misses when 4 or more arrive: 1 - e^-2.2 (1 + 2.2 + 2.2^2/2 + 2.2^3/6) = 0.18065.
    miss = tpot_miss_given_output(np.array([11.0, 1.0]), 0.02, 0.5, 5.0, 0.1, 0.05)
    assert miss[0] == pytest.approx(0.18065, abs=1e-5)
    # A one-token answer has no time per output token.
    assert miss[1] == 0.0


def test_tpot_miss_share_edges():
    # Steps slower than the target: every multi-token request misses; no prefill: none does.
    assert tpot_miss_share(0.06, 0.2, 1.0, 0.1, 100, 0.05) == 1.0
    assert tpot_miss_share(0.02, 0.0, 0.0, 0.1, 100, 0.05) == 0.0
    # More stalls per request (more prompts per second) can only miss more.
    assert tpot_miss_share(0.02, 0.5, 5.0, 0.1, 50, 0.05) > tpot_miss_share(0.02, 0.25, 2.5, 0.1, 50, 0.05) > 0


def test_tpot_miss_share_averages_over_the_measured_output_lengths():
    # Half the requests generate 2 tokens, half 1, as measured. A 2-token one lives 2 x 0.02 / 0.5 = 0.08 s,
    # meets 5 x 0.08 = 0.4 prompts, and may take (0.05 - 0.02) x 1 / 0.1 = 0.3, so no, stall: it misses with
    # P(K >= 1) = 1 - e^-0.4 = 0.32968. One-token answers never miss: 0.5 x 0.32968 = 0.16484.
    measured = tpot_miss_share(0.02, 0.5, 5.0, 0.1, 1.5, 0.05, shares({1: 0.5, 2: 0.5}))
    assert measured == pytest.approx(0.5 * (1 - math.exp(-0.4)))


def test_measured_long_answers_need_fewer_replicas_than_exponential_ones():
    # Exponential outputs of mean 128 put some at a few tokens, where one 0.1 s prefill stall misses 50 ms:
    # 2 replicas. Measured, every answer is 128 tokens long (the [128, 181) bucket): 1 replica carries it.
    exponential = slo_policy().size(Demand(500, 0, 10, 100, 128))
    measured = slo_policy().size(Demand(500, 0, 10, 100, 128, shares({128: 1.0})))
    assert (exponential.num_replicas, exponential.reason, measured.num_replicas) == (2, "slo_tpot", 1)


def test_output_lengths_are_measured_once_enough_requests_finished_in_the_window():
    policy = slo_policy(window_s=2)
    policy.decide(PoolObservation(0.0, 1, (report(100, 1, finished_per_s={7: 10, 300: 10}),)))
    # 20 finished in the 1 s decision period: fewer than 50, so lengths are taken as exponential.
    assert policy.demand().output_length_shares == ()
    policy.decide(PoolObservation(1.0, 1, (report(100, 1, finished_per_s={7: 30}),) * 2))
    # 20 + 2 x 30 = 80 finished: 70 of 7 tokens, 10 of 300.
    assert policy.demand().output_length_shares == shares({7: 70 / 80, 300: 10 / 80})
    for t in (2.0, 3.0, 4.0):
        policy.decide(PoolObservation(t, 1, (report(100, 1),)))
    # At 4 s both are more than 2 s old, and nothing finished since.
    assert policy.demand().output_length_shares == ()


def test_forecast_projects_a_ramp_along_its_line():
    times, values = list(range(11)), [10.0 * (t + 1) for t in range(11)]
    # 10 more per second; the mean, 60, sits at t = 5: at t = 10 + 5 the line gives 60 + 10 x (10 - 5 + 5) = 160.
    assert forecast(times, values, 5) == pytest.approx(160)
    # The level from the last 2 s (t = 8-10: 100, mean at t = 9), carried on the same slope: 100 + 10 x 6 = 160.
    assert forecast(times, values, 5, level_s=2) == pytest.approx(160)


def test_forecast_is_the_mean_until_the_history_spans_the_horizon():
    # 3 s of history projected 5 s ahead: the mean, 25.
    assert forecast([0, 1, 2, 3], [10, 20, 30, 40], 5) == pytest.approx(25)


def test_forecast_never_falls_below_the_window_mean():
    # A falling ramp projects below zero; the mean, 25, is the floor.
    assert forecast([0, 1, 2, 3], [40, 30, 20, 10], 3) == pytest.approx(25)
    assert forecast([7], [12], 5) == 12


def test_prefill_cap_sizes_the_pool_when_set():
    sizing = slo_policy(target_prefill_high=0.5).size(Demand(1600, 0, 0, 100))
    # 1,600 tokens/s over 1,000 per replica at most 0.5 utilized: 1.6 / 0.5 = 3.2, so 4 replicas.
    assert (sizing.num_replicas, sizing.reason) == (4, "slo_prefill")


def test_ttft_target_sizes_the_pool_without_a_cap():
    sizing = slo_policy().size(Demand(1600, 0, 0, 200))
    # 200-token prompts are 0.2 s of prefill: at most 1% over 2 s needs exp(-(1 - rho) x 10) <= 0.01, rho <=
    # 1 - ln(100) / 10 = 0.5395. Two replicas run at 0.8; three at 0.533.
    assert (sizing.num_replicas, sizing.reason) == (3, "slo_prefill")
    assert sizing.misses.ttft == pytest.approx(math.exp(-(1 - 1600 / 3000) * 10))


def test_kv_demand_sizes_a_decode_pool_at_the_kv_fill():
    sizing = slo_policy(pool="decode").size(Demand(5000, 20_000, 30, 100, 100))
    # Prefill is not a decode pool's load. KV: 20,000 tokens over 0.9 x 10,000 per replica = 2.2, so 3; a
    # step of 30 / 3 = 10 sequences takes 0.01 + 10 x 0.001 = 0.02 s, within 50 ms.
    assert (sizing.num_replicas, sizing.reason) == (3, "slo_kv")
    assert (sizing.misses.decode_step_s, sizing.misses.tpot) == (pytest.approx(0.02), 0.0)


def test_decode_steps_cost_the_sequences_and_the_kv_they_read():
    profile = PROFILE.model_copy(update={"decode_step_per_kv_token_s": 1e-5})
    sizing = slo_policy(pool="decode", profile=profile).size(Demand(0, 5000, 100, 100, 100))
    # A step over n replicas: 0.01 + (100 / n) x 0.001 + (5,000 / n) x 1e-5 = 0.01 + 0.15 / n s; within 50 ms
    # from n = 4 (0.0475 s); at 3 it is 0.06 s and every request misses.
    assert (sizing.num_replicas, sizing.reason) == (4, "slo_tpot")
    assert sizing.misses.decode_step_s == pytest.approx(0.0475)


def test_colocated_pools_are_sized_on_both_misses():
    demand = Demand(500, 0, 10, 100, 101)
    sizing = slo_policy().size(demand)
    # Each count's expected misses, as miss_shares computes them: the first at or under 1% in all is chosen.
    shares = [miss_shares(PROFILE, demand, n, 2.0, 0.05) for n in range(1, 9)]
    first = next(n for n, share in enumerate(shares, 1) if share.ttft + share.tpot <= 0.01)
    assert sizing.num_replicas == first > 1 and sizing.reason == "slo_tpot"
    assert shares[first - 2].tpot > shares[first - 2].ttft


def test_a_prefill_pool_ignores_kv_and_sequences():
    sizing = slo_policy(pool="prefill", target_prefill_high=0.5).size(Demand(900, 90_000, 500, 100, 100))
    # 0.9 / 0.5 = 1.8, so 2 replicas; its KV is transient and its sequences are handed to decode.
    assert (sizing.num_replicas, sizing.reason, sizing.misses.tpot) == (2, "slo_prefill", 0.0)


def test_demand_too_big_for_max_replicas_asks_for_max():
    sizing = slo_policy(target_prefill_high=0.5).size(Demand(100_000, 0, 0, 100))
    assert (sizing.num_replicas, sizing.reason) == (8, "slo_prefill")


def test_decide_scales_up_for_the_demand_forecast_one_startup_ahead():
    policy = slo_policy(target_prefill_high=0.5, window_s=30, profile=PROFILE.model_copy(update={"startup_s": 4}))
    decision = None
    for t, rate in enumerate([100, 200, 300, 400, 500, 600, 700]):
        decision = policy.decide(PoolObservation(float(t), 1, (report(rate, rate / 100),)))
    # Demand over the intervals ending at 1-6 s: 200-700 tokens/s (no backlog), rising 100 per second; its
    # mean, 450, sits at 3.5 s. One start-up (4 s) plus one decision (1 s) past 6 s: 450 + 100 x (6 - 3.5 + 5)
    # = 1,200 tokens/s, which needs 1.2 / 0.5 = 2.4, so 3 replicas, though 700 tokens/s fit 2 now.
    assert (decision.desired_replicas, decision.reason) == (3, "slo_prefill")


def test_a_backlog_counts_as_demand_drained_within_the_ttft_target():
    # 300 pending tokens over the 2 s TTFT target add 150 tokens/s: one replica carries it.
    light = slo_policy(target_prefill_high=0.5).decide(PoolObservation(0.0, 1, (report(pending=300),)))
    assert light.desired_replicas == 1
    # 3,000 add 1,500 tokens/s: 1.5 / 0.5 = 3 replicas, each exactly at the cap.
    heavy = slo_policy(target_prefill_high=0.5).decide(PoolObservation(0.0, 1, (report(pending=3000),)))
    assert (heavy.desired_replicas, heavy.reason) == (3, "slo_prefill")


def test_mean_prompt_and_output_are_measured_per_first_token():
    policy = slo_policy()
    policy.decide(PoolObservation(0.0, 1, (report(2000, 4, generated_per_s=600),)))
    # 2,000 prompt tokens/s and 600 generated tokens/s over 4 first tokens/s: 500-token prompts, 150-token outputs.
    demand = policy.demand()
    assert (demand.mean_prompt_tokens, demand.mean_output_tokens) == (500, 150)


def test_scale_down_waits_one_startup_then_goes_to_the_most_needed_since():
    policy = slo_policy(target_prefill_high=0.5, window_s=1)
    policy.envelope_s = 0.0  # this test is the hold's; the next is the envelope's
    # 4 x 1,600 = 6,400 tokens/s of 100-token prompts needs 6.4 / 0.5 = 12.8: capped at 8.
    assert policy.decide(PoolObservation(0.0, 4, (report(1600, 16),) * 4)).desired_replicas == 8
    quiet = [policy.decide(PoolObservation(float(t), 8, (report(100, 1),) * 8)) for t in range(1, 12)]
    # From 1 s, 8 x 100 = 800 tokens/s (the interval since 0 s) needs 2; 8 were needed at 0 s: held through
    # 10 s (one start-up), then 2.
    assert [d.desired_replicas for d in quiet] == [8] * 10 + [2]
    assert quiet[-1].reason == "slo_down" and quiet[1].reason == "hold"


def test_scale_down_keeps_what_carried_99_percent_of_the_envelopes_requests():
    policy = slo_policy(target_prefill_high=0.5, window_s=1)
    # A burst: 64 requests/s got a first token while 8 replicas were needed.
    policy.decide(PoolObservation(0.0, 4, (report(1600, 16),) * 4))
    quiet = [policy.decide(PoolObservation(float(t), 8, (report(100, 1),) * 8)) for t in range(1, 303)]
    # Then 8 requests/s needing 2. The envelope is 300 s (five 10 s start-ups are less than ENVELOPE_MIN_S);
    # at 300 s the burst's 64 are still 64 / (64 + 300 x 8) = 2.6% of its requests: 2 replicas would fail
    # them, more than 1%, so 8 stay. At 301 s the burst has left the envelope.
    assert [d.desired_replicas for d in quiet] == [8] * 300 + [2, 2]


def test_the_envelope_spans_five_startups_and_at_least_five_minutes():
    short = slo_policy(profile=PROFILE.model_copy(update={"startup_s": 10}))
    long = slo_policy(profile=PROFILE.model_copy(update={"startup_s": 120}))
    # 5 x 10 s = 50 s is less than 300 s; 5 x 120 s = 600 s.
    assert (short.envelope_s, long.envelope_s) == (300, 600)


def test_the_starting_replicas_are_held_one_startup():
    policy = slo_policy()
    decisions = [policy.decide(PoolObservation(float(t), 3, (report(100, 1),) * 3)) for t in range(12)]
    # 300 tokens/s needs one replica, but the pool started with 3 at 0 s: held through 10 s (one start-up).
    assert [d.desired_replicas for d in decisions] == [3] * 11 + [1]


def test_scale_to_zero_after_idle_and_wake_on_work():
    policy = slo_policy(min_replicas=0, idle_to_zero_s=5)
    idle = [policy.decide(PoolObservation(float(t), 1, (report(),))) for t in range(7)]
    # Idle from 0 s: at 5 s it has been idle for idle_to_zero_s.
    assert [d.desired_replicas for d in idle][4:] == [1, 0, 0]
    assert idle[5].reason == "idle_to_zero"
    woken = policy.decide(PoolObservation(8.0, 0, (), num_queued=2))
    assert (woken.desired_replicas, woken.reason) == (1, "wake")


def test_make_policy_builds_the_slo_policy_from_its_block():
    block = {"policy": "slo", "ttft_p99_s": 1.5, "tpot_p99_s": 0.04, "profile": {"kv_capacity_tokens": 5000,
             "prefill_tokens_per_s": 2000, "startup_s": 30}, "max_replicas": 6}
    policy = make_policy(parse_section(AutoscalingConfig, block, "pool.yaml"))
    assert isinstance(policy, SLOPolicy)
    # The hold is one start-up unless scale_down_cooldown_s overrides it; the KV fill 0.9 unless target_high does.
    assert (policy.hold_s, policy.kv_fill, policy.ttft_s) == (30, 0.9, 1.5)


@pytest.mark.parametrize("block, message", [
    ({"policy": "slo", "ttft_p99_s": 2}, "policy slo needs tpot_p99_s, profile"),
    ({"policy": "slo", "ttft_p99_s": 2, "tpot_p99_s": 0.05, "profile": {}, "kv_lookahead_s": 30},
     "policy slo does not read kv_lookahead_s (kv_cache only)"),
    ({"policy": "slo", "ttft_p99_s": 2, "tpot_p99_s": 0.05, "profile": {"startup": 30}}, "profile.startup: unknown key"),
    ({"policy": "kv_cache", "ttft_p99_s": 2}, "ttft_p99_s (slo only)"),
])
def test_a_bad_slo_block_is_refused_naming_the_key(block, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_section(AutoscalingConfig, block, "pool.yaml")
