"""Cache-aware routing with two real replicas: groups stick to a replica and the engines' prefix cache hits more."""

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


@pytest.fixture(scope="module")
def events_app(served):
    """The tiny model on 2 replicas (one per core) routed cache-aware from the engines' KV events."""
    from ray import serve

    from conftest import Served
    from factories import model_entry
    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import parse_config

    config = parse_config({"models": [{
        **model_entry("tiny-kv-events"), "replicas": 2,
        "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]},
        "routing": {"policy": "cache_aware", "prefix_source": "kv_events"}}]})
    serve.run(build_app(config), name="routing-events", route_prefix="/routing-events")
    yield Served(base_url=f"{served.base_url}/routing-events", config=config, handles={})
    serve.delete("routing-events")


def test_kv_event_routing_keeps_groups_together_from_the_engines_own_caches(events_app):
    groups, reasons, hit_rate = send_workload(events_app.api_url, "tiny-kv-events")
    assert all(len(replicas) == 1 for replicas in groups.values())
    assert len(set().union(*groups.values())) == 2
    # As with the routed index: 8 first requests by load, 24 hits, now confirmed by the engines' events.
    assert reasons.count("cache_hit") == 24 and reasons.count("load") == 8
    # Each prefix is computed once per group: 24 of 32 requests reuse ~300 shared words of ~310.
    assert hit_rate > 0.6, hit_rate
