"""Cache-aware routing with two real replicas: groups stick to a replica and the engines' prefix cache hits more.

Routing on the engines' own KV events (prefix_source: kv_events) is tested with the same workload and
assertions across two nodes, in tests/multinode/test_multinode_served.py.
"""

import pytest

from cluster_helpers import send_workload

pytestmark = pytest.mark.slow


def test_cache_aware_keeps_groups_together_and_raises_engine_hit_rate(two_replica_app):
    routing_app = two_replica_app.api_url
    groups, reasons, hit_rate = send_workload(routing_app, "tiny-cache-aware")
    assert all(len(replicas) == 1 for replicas in groups.values())  # each group on one replica
    assert len(set().union(*groups.values())) == 2                  # and both replicas are used
    # 8 groups' first requests find nothing cached; the other 24 hit.
    assert reasons.count("cache_hit") == 24 and reasons.count("load") == 8
    default_groups, default_reasons, default_hit_rate = send_workload(routing_app, "tiny-default")
    assert set(default_reasons) == {None}  # Serve's own router: no fleetserve decision
    # Cache-aware recomputes each prefix once (8 misses in 32); the default router scatters groups
    # and recomputes each prefix on both replicas (~15 misses expected).
    assert hit_rate > default_hit_rate + 0.1, (hit_rate, default_hit_rate)

