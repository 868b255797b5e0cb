"""Autoscaling policies on hand-built pool observations, with the arithmetic in comments."""

from __future__ import annotations

import pytest

from fleetserve.autoscaler.policy import (
    KVCachePolicy,
    OngoingRequestsPolicy,
    PoolObservation,
    QueueDepthPolicy,
)
from fleetserve.autoscaler.policies import make_policy
from fleetserve.platform.config import AutoscalingConfig, ConfigError, parse_section
from fleetserve.platform.replica_report import ReplicaReport


def obs(time_s: float, *kv: float, waiting: int = 0, running: int = 1, queued: int = 0,
        ttft: float | None = None, num_replicas: int | None = None) -> PoolObservation:
    """A pool observation with one ReplicaReport per KV usage given."""
    replicas = tuple(ReplicaReport(kv_cache_usage=u, num_waiting=waiting, num_running=running, ttft_s=ttft) for u in kv)
    return PoolObservation(time_s, len(kv) if num_replicas is None else num_replicas, replicas, queued)


def bounds(**knobs) -> dict:
    """Replica bounds and HPA behaviour: min 1, max 8 unless given."""
    return {"min_replicas": 1, "max_replicas": 8, **knobs}


def kv_policy(**knobs) -> KVCachePolicy:
    given = knobs.pop("limits", bounds(downscale_stabilization_s=0))
    return KVCachePolicy(AutoscalingConfig(**given, **knobs))


def test_high_kv_scales_up_in_proportion_capped_by_the_step():
    policy = kv_policy(target_high=0.75)
    decision = policy.decide(obs(0, 0.9, 0.9))
    # ceil(2 * 0.9 / 0.75) = ceil(2.4) = 3 replicas.
    assert (decision.desired_replicas, decision.reason) == (3, "kv_high")
    decision = kv_policy(target_high=0.5).decide(obs(0, 1.0, 1.0))
    # ceil(2 * 1.0 / 0.5) = 4, but max_step_up 2 -> 2 + 2 = 4; with 1.0/0.4 it would be 5 -> capped at 4.
    assert decision.desired_replicas == 4
    assert kv_policy(target_high=0.4).decide(obs(0, 1.0, 1.0)).desired_replicas == 4


def test_kv_mean_is_taken_over_the_window():
    policy = kv_policy(target_high=0.75, window_s=30)
    assert policy.decide(obs(0, 0.5)).reason == "hold"
    # Window holds 0.5 and 0.9: mean 0.7 <= 0.75 -> hold; a single spike does not scale.
    assert policy.decide(obs(10, 0.9)).reason == "hold"
    # At t=45 the 0.5 sample (t=0) has left the 30 s window: mean(0.9, 0.9) = 0.9 > 0.75.
    assert policy.decide(obs(45, 0.9)).reason == "kv_high"


def test_queue_scales_up_even_with_low_kv():
    # 1 replica, 5 queued + 2 waiting in the engine = 7 > 2 per replica -> ceil(7 / 2) = 4, step-capped at 1 + 2 = 3.
    decision = kv_policy().decide(obs(0, 0.1, waiting=2, queued=5))
    assert (decision.desired_replicas, decision.reason) == (3, "queue")


def test_pool_kinds_use_their_own_signals():
    # Decode ignores TTFT; prefill ignores KV; colocated uses both.
    assert kv_policy(pool="decode").decide(obs(0, 0.5, ttft=9.0)).reason == "hold"
    assert kv_policy(pool="prefill").decide(obs(0, 0.99)).reason == "hold"
    assert kv_policy(pool="prefill").decide(obs(0, 0.5, ttft=5.0)).reason == "ttft"
    assert kv_policy(pool="colocated").decide(obs(0, 0.99)).reason == "kv_high"


def test_scale_down_waits_for_the_cooldown_and_hysteresis_holds():
    policy = kv_policy(target_low=0.35, target_high=0.75, scale_down_cooldown_s=60, window_s=5)
    assert policy.decide(obs(0, 0.5, 0.5)).reason == "hold"  # between the targets: hysteresis
    assert policy.decide(obs(10, 0.1, 0.1)).reason == "cooldown"  # low since t=10
    assert policy.decide(obs(69, 0.1, 0.1)).reason == "cooldown"  # 59 s < 60 s
    decision = policy.decide(obs(70, 0.1, 0.1))
    assert (decision.desired_replicas, decision.reason) == (1, "kv_low")
    # Waiting work resets the low timer.
    assert policy.decide(obs(80, 0.1, waiting=1)).reason == "hold"


def test_downscale_stabilization_keeps_the_highest_recent_recommendation():
    limits = bounds(min_replicas=1, max_replicas=8, downscale_stabilization_s=100)
    policy = kv_policy(scale_down_cooldown_s=0, window_s=1, limits=limits)
    assert policy.decide(obs(0, 0.5, 0.5, 0.5)).desired_replicas == 3  # recommends 3 (hold)
    decision = policy.decide(obs(10, 0.0, 0.0, 0.0))  # recommends 2, but 3 was recommended 10 s ago
    assert (decision.desired_replicas, decision.reason) == (3, "stabilizing")
    assert policy.decide(obs(111, 0.0, 0.0, 0.0)).desired_replicas == 2  # the 3s left the 100 s window


def test_limits_clamp_and_say_so():
    limits = bounds(min_replicas=2, max_replicas=3, downscale_stabilization_s=0)
    assert kv_policy(limits=limits).decide(obs(0, 1.0, 1.0, 1.0)).reason == "max_replicas"
    # 2 of at most 3 replicas at 0.9 usage, target 0.5: ceil(2 * 0.9 / 0.5) = 4, trimmed to 3 -- still
    # reported as kv_high (what asked for it), with the cap in the detail.
    decision = kv_policy(limits=limits, target_high=0.5).decide(obs(0, 0.9, 0.9))
    assert (decision.desired_replicas, decision.reason) == (3, "kv_high")
    assert "capped at max_replicas 3" in decision.detail
    policy = kv_policy(limits=limits, scale_down_cooldown_s=0, window_s=1)
    decision = policy.decide(obs(0, 0.0, 0.0, 0.0))  # 3 replicas idle: may go to 2
    assert (decision.desired_replicas, decision.reason) == (2, "kv_low")
    decision = policy.decide(obs(1, 0.0, 0.0))  # at min_replicas: holds rather than cycling
    assert (decision.desired_replicas, decision.reason) == (2, "hold")
    # Below the minimum (a config change raised it), a hold is lifted to the minimum and says so.
    decision = kv_policy(limits=limits).decide(obs(0, 0.5))
    assert (decision.desired_replicas, decision.reason) == (2, "min_replicas")


def test_scale_to_zero_after_idle_and_wake_on_first_request():
    limits = bounds(min_replicas=0, max_replicas=4, downscale_stabilization_s=0)
    policy = kv_policy(limits=limits, idle_to_zero_s=300, scale_down_cooldown_s=10_000, window_s=1)
    assert policy.decide(obs(0, 0.0, running=0)).reason == "hold"  # one replica is the least the load needs
    decision = policy.decide(obs(300, 0.0, running=0))
    assert (decision.desired_replicas, decision.reason) == (0, "idle_to_zero")
    assert policy.decide(PoolObservation(310, 0)).desired_replicas == 0
    decision = policy.decide(PoolObservation(320, 0, (), num_queued=1))
    assert (decision.desired_replicas, decision.reason) == (1, "wake")


def test_ray_default_waits_its_upscale_delay():
    policy = OngoingRequestsPolicy(AutoscalingConfig(policy="ray_default", target_ongoing_requests=2, upscale_delay_s=30,
                                                      max_replicas=8))
    busy = dict(running=4)  # 2 replicas x 4 running = 8 ongoing -> ceil(8 / 2) = 4 wanted
    assert policy.decide(obs(0, 0.5, 0.5, **busy)).reason == "cooldown"
    assert policy.decide(obs(29, 0.5, 0.5, **busy)).desired_replicas == 2
    decision = policy.decide(obs(30, 0.5, 0.5, **busy))
    assert (decision.desired_replicas, decision.reason) == (4, "ongoing_requests")


def test_queue_depth_policy_divides_ongoing_by_its_target():
    # 2 replicas, 3 running each + 6 queued = 12 ongoing; / 4 per replica = 3.
    decision = QueueDepthPolicy(AutoscalingConfig(policy="queue_depth", max_replicas=8)).decide(obs(0, 0.1, 0.1, running=3, queued=6))
    assert decision.desired_replicas == 3


def test_make_policy_runs_the_policy_the_block_names_with_its_knobs():
    policy = make_policy(parse_section(AutoscalingConfig, {"policy": "kv_cache", "target_high": 0.6,
                                                           "max_replicas": 3}, "test"))
    assert isinstance(policy, KVCachePolicy)
    assert policy.config.target_high == 0.6 and policy.config.max_replicas == 3
    assert policy.config.max_step_up == 2  # untouched knobs keep the platform's defaults
    assert isinstance(make_policy(AutoscalingConfig(policy="ray_default")), OngoingRequestsPolicy)
    assert isinstance(make_policy(AutoscalingConfig(policy="queue_depth")), QueueDepthPolicy)


@pytest.mark.parametrize(("block", "message"), [
    ({"policy": "hpa"}, "policy: Input should be 'kv_cache', 'ray_default', 'queue_depth' or 'slo' (got 'hpa')"),
    ({"target_hgih": 0.6}, "target_hgih: unknown key"),
    # Serve's own policy reads none of the KV rule's knobs, nor our step limits: they would do nothing.
    ({"policy": "ray_default", "target_high": 0.6, "max_step_up": 4},
     "policy ray_default does not read max_step_up (kv_cache/queue_depth only), target_high (kv_cache/slo only)"),
    ({"policy": "kv_cache", "target_ongoing_requests": 8}, "target_ongoing_requests (ray_default only)"),
])
def test_a_block_with_a_bad_or_foreign_knob_is_refused_naming_it(block, message):
    with pytest.raises(ConfigError) as caught:
        parse_section(AutoscalingConfig, block, "policy.yaml")
    assert message in str(caught.value) and "policy.yaml" in str(caught.value)


def test_ray_default_ignores_step_limits_as_serve_does():
    policy = OngoingRequestsPolicy(AutoscalingConfig(policy="ray_default", target_ongoing_requests=1,
                                                     upscale_delay_s=0, max_replicas=8))
    # 1 replica with 6 running: ceil(6 / 1) = 6 at once; HPA's default step (2) would have allowed 3.
    assert policy.decide(obs(0, 0.5, running=6)).desired_replicas == 6


def prefill_obs(time_s: float, *rates: float, pending: tuple[int, ...] = (), num_replicas: int | None = None,
                waiting: int = 0) -> PoolObservation:
    """Replicas that computed ``rates`` prompt tokens/s, with ``pending`` prompt tokens of backlog each."""
    pending = pending or (0,) * len(rates)
    replicas = tuple(ReplicaReport(prompt_tokens_per_s=rate, num_pending_prompt_tokens=backlog, num_waiting=waiting)
                     for rate, backlog in zip(rates, pending))
    return PoolObservation(time_s, len(rates) if num_replicas is None else num_replicas, replicas)


def test_prefill_work_scales_up_to_the_count_that_keeps_it_under_target():
    policy = kv_policy(prefill_tokens_per_s=1000, target_prefill_high=0.5, window_s=30)
    decision = policy.decide(prefill_obs(0, 600, 600))
    # 1200 prompt tokens/s = 1.2 replicas' worth; ceil(1.2 / 0.5) = 3.
    assert (decision.desired_replicas, decision.reason) == (3, "prefill_high")
    # 2 x 200 tokens/s = 0.4 replicas' worth; ceil(0.4 / 0.5) = 1 <= 2: holds.
    assert kv_policy(prefill_tokens_per_s=1000).decide(prefill_obs(0, 200, 200)).reason == "hold"


def test_prefill_backlog_growth_counts_as_demand():
    policy = kv_policy(prefill_tokens_per_s=1000, target_prefill_high=0.6, window_s=30,
                       limits=bounds(max_replicas=8, max_step_up=8, downscale_stabilization_s=0))
    assert policy.decide(prefill_obs(0, 300, 300)).reason == "hold"  # 0.6 replicas' worth <= 2 * 0.6
    decision = policy.decide(prefill_obs(10, 300, 300, pending=(4000, 1000)))
    # Computed 600 tokens/s plus a backlog grown by 5000 tokens in 10 s: 1100 tokens/s = 1.1 replicas'
    # worth; ceil(1.1 / 0.6) = 2, no more than the 2 there are.
    assert decision.reason == "hold"
    decision = policy.decide(prefill_obs(20, 300, 300, pending=(16000, 4000)))
    # 600 + 20000 / 20 = 1600 tokens/s -> ceil(1.6 / 0.6) = 3.
    assert (decision.desired_replicas, decision.reason) == (3, "prefill_high")


def test_prefill_rule_needs_a_prefill_throughput():
    # Without prefill_tokens_per_s (or in a decode pool) the same load is seen only through queues and
    # TTFT: 2 replicas stay 2 (here on the way down, since their KV is empty).
    assert kv_policy().decide(prefill_obs(0, 6000, 6000)).desired_replicas == 2
    assert kv_policy(pool="decode", prefill_tokens_per_s=1000).decide(prefill_obs(0, 6000, 6000)).desired_replicas == 2
    assert kv_policy(pool="prefill", prefill_tokens_per_s=1000).decide(prefill_obs(0, 6000)).reason == "prefill_high"


def test_starting_replicas_count_against_a_scale_up():
    # 2 ready replicas at 0.9 and one starting: ceil((0.9 + 0.9) / 0.75) = ceil(2.4) = 3 = the 3 there are.
    assert kv_policy(target_high=0.75).decide(obs(0, 0.9, 0.9, num_replicas=3)).reason == "hold"
    # At 1.0 each: ceil(2.0 / 0.75) = 3 again; at 1.0 with target 0.6: ceil(3.33) = 4 > 3.
    decision = kv_policy(target_high=0.6).decide(obs(0, 1.0, 1.0, num_replicas=3))
    assert (decision.desired_replicas, decision.reason) == (4, "kv_high")


def test_ttft_rule_waits_for_a_starting_replica():
    assert kv_policy().decide(obs(0, 0.1, 0.1, ttft=5.0, num_replicas=3)).reason == "hold"
    decision = kv_policy().decide(obs(0, 0.1, 0.1, ttft=5.0))
    assert (decision.desired_replicas, decision.reason) == (3, "ttft")


def test_scale_down_goes_to_the_largest_count_the_cooldown_saw():
    limits = bounds(min_replicas=1, max_replicas=8, max_step_down=4, downscale_stabilization_s=0)
    policy = kv_policy(prefill_tokens_per_s=1000, target_prefill_low=0.3, scale_down_cooldown_s=20, window_s=1,
                       limits=limits)
    # 6 replicas computing 100 tokens/s each: 0.6 replicas' worth; ceil(0.6 / 0.3) = 2 fit at the low target.
    assert policy.decide(prefill_obs(0, *[100] * 6)).reason == "cooldown"
    # 6 x 150 = 0.9 replicas' worth -> ceil(0.9 / 0.3) = 3 fit.
    assert policy.decide(prefill_obs(10, *[150] * 6)).reason == "cooldown"
    decision = policy.decide(prefill_obs(20, *[100] * 6))
    # Low for 20 s: down to the largest count of the cooldown, 3 (6 - 3 is within max_step_down 4).
    assert (decision.desired_replicas, decision.reason) == (3, "prefill_low")
    assert "fits 3 at the low targets" in decision.detail


def test_scale_down_keeps_room_for_waiting_requests_and_starting_replicas():
    policy = kv_policy(scale_down_cooldown_s=0, window_s=1, max_waiting_per_replica=2,
                       limits=bounds(min_replicas=1, max_replicas=8, max_step_down=8, downscale_stabilization_s=0))
    # 4 idle replicas with 1 waiting each: KV fits 1, but 4 waiting / 2 per replica needs 2.
    decision = policy.decide(obs(0, 0.0, 0.0, 0.0, 0.0, waiting=1))
    assert (decision.desired_replicas, decision.reason) == (2, "kv_low")
    # One of 3 replicas still starting: no scale-down until it reports.
    assert policy.decide(obs(1, 0.0, 0.0, num_replicas=3)).reason == "hold"


def test_kv_lookahead_sizes_for_the_trend_a_start_up_ahead():
    policy = kv_policy(target_high=0.75, window_s=30, kv_lookahead_s=60,
                       limits=bounds(max_replicas=8, max_step_up=8, downscale_stabilization_s=0))
    # One sample has no trend: KV 0.3 fits one replica.
    assert policy.decide(obs(0, 0.3, 0.3)).reason == "hold"
    decision = policy.decide(obs(10, 0.4, 0.4))
    # The sum rose 0.6 -> 0.8 in 10 s (0.02/s); the fit at 10 s is 0.8, plus 0.02 x 60 s ahead = 2.0
    # replicas' worth: ceil(2.0 / 0.75) = 3, while the window mean (0.7) alone fits the 2 there are.
    assert (decision.desired_replicas, decision.reason) == (3, "kv_high")
    assert kv_policy(target_high=0.75, window_s=30).decide(obs(0, 0.3, 0.3)).reason == "hold"


def test_kv_lookahead_never_sizes_below_the_window_mean():
    policy = kv_policy(target_high=0.75, window_s=30, kv_lookahead_s=60)
    policy.decide(obs(0, 0.9, 0.9))
    # Falling 1.8 -> 1.6: the projection (1.6 - 0.02 x 60 = 0.4) is below the mean 1.7; the mean rules:
    # ceil(1.7 / 0.75) = 3 > 2.
    assert policy.decide(obs(10, 0.8, 0.8)).desired_replicas == 3
