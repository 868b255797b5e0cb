"""Every autoscaling policy by its config name: what the platform serves and the simulator replays."""

from __future__ import annotations

from fleetserve.autoscaler.policy import KVCachePolicy, OngoingRequestsPolicy, Policy, QueueDepthPolicy
from fleetserve.autoscaler.slo_policy import SLOPolicy
from fleetserve.platform.config import AutoscalingConfig

POLICIES: dict[str, type] = {"kv_cache": KVCachePolicy, "ray_default": OngoingRequestsPolicy,
                             "queue_depth": QueueDepthPolicy, "slo": SLOPolicy}


def make_policy(config: AutoscalingConfig) -> Policy:
    """The policy ``config.policy`` names, reading ``config``'s knobs."""
    return POLICIES[config.policy](config)
