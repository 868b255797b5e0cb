"""Disaggregated pools within a ratio: the fewest replicas a pool needs to keep its share of the other.

Pure Python (no Ray). Each pool's policy decides on its own signals; then the pool that falls below its
share of the other pool's latest count is raised to it. Raising only (never capping) lets the pair
follow whichever pool's load leads, and settles back as that pool shrinks.
"""

from __future__ import annotations

import math

from fleetserve.autoscaler.policy import Decision
from fleetserve.platform.config import AutoscalingConfig, PDRatio

PEER = {"prefill": "decode", "decode": "prefill"}


def ratio_floor(pool: str, peer_replicas: int, ratio: PDRatio) -> int:
    """Replicas ``pool`` needs beside ``peer_replicas`` of the other pool: ``min`` prefill per decode raises
    the prefill pool, ``max`` prefill per decode raises the decode pool; 0 when no bound applies."""
    if pool == "prefill" and ratio.min is not None:
        return math.ceil(peer_replicas * ratio.min - 1e-9)
    if pool == "decode" and ratio.max is not None:
        return math.ceil(peer_replicas / ratio.max - 1e-9)
    return 0


def within_ratio(decision: Decision, pool: str, peer_replicas: int | None, ratio: PDRatio,
                 config: AutoscalingConfig) -> Decision:
    """``decision`` raised to the pool's share of its peer (at most its own ``max_replicas``); unchanged when
    the peer's count is not known yet or the decision already keeps the ratio."""
    if peer_replicas is None:
        return decision
    floor = min(ratio_floor(pool, peer_replicas, ratio), config.max_replicas)
    if decision.desired_replicas >= floor:
        return decision
    bound = f"min {ratio.min:g}" if pool == "prefill" else f"max {ratio.max:g}"
    return Decision(floor, "pd_ratio", f"{decision.detail}; {peer_replicas} {PEER[pool]} replica(s) at pd_ratio "
                                       f"{bound} prefill per decode need {floor} (wanted {decision.desired_replicas})")
