"""pd_ratio: a disaggregated model's two pools kept within a ratio, raising the one that falls behind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleetserve.autoscaler import serve_adapter
from fleetserve.autoscaler.pd_ratio import ratio_floor, within_ratio
from fleetserve.autoscaler.policy import Decision
from fleetserve.autoscaler.serve_adapter import ServeAutoscalingPolicy
from fleetserve.deployments.serve_options import deployment_options
from fleetserve.platform.config import AutoscalingConfig, ConfigError, PDRatio, parse_config


def test_ratio_floor_raises_prefill_by_min_and_decode_by_max():
    ratio = PDRatio(min=0.5, max=2.0)
    # 5 decode replicas at >= 0.5 prefill each: ceil(2.5) = 3 prefill. 5 prefill at <= 2 per decode: ceil(2.5) = 3.
    assert ratio_floor("prefill", 5, ratio) == 3
    assert ratio_floor("decode", 5, ratio) == 3
    # Exact ratios need no extra replica: 4 x 0.5 = 2.
    assert ratio_floor("prefill", 4, ratio) == 2
    assert ratio_floor("prefill", 4, PDRatio(max=2.0)) == 0


def test_within_ratio_raises_only_and_at_most_to_max_replicas():
    config = AutoscalingConfig(pool="prefill", min_replicas=1, max_replicas=3)
    ratio = PDRatio(min=1.0)
    raised = within_ratio(Decision(1, "hold", "kv 0.10"), "prefill", 6, ratio, config)
    # 6 decode at >= 1 prefill each asks 6; the pool's own max_replicas is 3.
    assert (raised.desired_replicas, raised.reason) == (3, "pd_ratio")
    assert "6 decode replica(s) at pd_ratio min 1 prefill per decode need 3 (wanted 1)" in raised.detail
    kept = Decision(4, "queue")
    assert within_ratio(kept, "prefill", 2, ratio, config) is kept
    assert within_ratio(Decision(1, "hold"), "prefill", None, ratio, config).desired_replicas == 1


def context(app: str, queued: int = 0, target: int = 1, now: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(current_time=now, aggregated_metrics={}, running_replicas=[], total_queued_requests=queued,
                           target_num_replicas=target, policy_state={}, app_name=app)


def adapter(pool: str, ratio: dict, **knobs) -> ServeAutoscalingPolicy:
    policy = ServeAutoscalingPolicy("pd", {"pool": pool, "min_replicas": 1, "max_replicas": 4,
                                           "max_waiting_per_replica": 1, "max_step_up": 4, "decision_period_s": 1, **knobs},
                                    ratio)
    policy._metrics = SimpleNamespace(record=SimpleNamespace(remote=lambda *args: None))  # no metrics actor
    return policy


def test_served_pools_read_each_others_targets(monkeypatch):
    monkeypatch.setattr(serve_adapter, "_POOL_TARGETS", {})
    decode, prefill = adapter("decode", {"min": 0.5}), adapter("prefill", {"min": 0.5})
    # 4 queued requests over 1 decode replica, at most 1 waiting each: the decode pool asks for 4.
    assert decode(context("app-a", queued=4))[0] == 4
    # The prefill pool has no work of its own, but 4 decode replicas at >= 0.5 prefill each need 2.
    desired, state = prefill(context("app-a"))
    assert (desired, state["reason"]) == (2, "pd_ratio")
    # Another application's pools of the same model name are not this one's peers.
    assert adapter("prefill", {"min": 0.5})(context("app-b"))[0] == 1


def test_pd_ratio_reaches_each_pools_adapter_through_the_serve_options():
    pools = {"replicas": 1, "autoscaling": {"policy": "kv_cache", "min_replicas": 1, "max_replicas": 3}}
    config = parse_config({"models": [{"name": "pd", "source": "tiny-random-llama", "disaggregation": {
        "prefill": pools, "decode": pools, "pd_ratio": {"min": 0.5}}}]})
    model = config.models[0]
    for pool in ("prefill", "decode"):
        options = deployment_options(model.pool_model(pool), config.server)
        kwargs = options["autoscaling_config"]["policy"]["policy_kwargs"]
        assert kwargs["pd_ratio"] == {"min": 0.5, "max": None} and kwargs["autoscaling"]["pool"] == pool


@pytest.mark.parametrize("disaggregation, message", [
    ({"pd_ratio": {"min": 1}}, "the prefill pool has no autoscaling"),
    ({"prefill": {"autoscaling": {}}, "decode": {"autoscaling": {"policy": "ray_default"}}, "pd_ratio": {"min": 1}},
     "the decode pool uses ray_default"),
    ({"pd_ratio": {}}, "set min, max or both"),
    ({"pd_ratio": {"min": 2, "max": 1}}, r"min \(2.0\) exceeds max \(1.0\)"),
])
def test_a_pd_ratio_that_cannot_work_is_refused(disaggregation, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"models": [{"name": "pd", "source": "tiny-random-llama", "disaggregation": disaggregation}]})
