"""fleetserve's Serve request router, driven by hand: what it counts as each replica's load."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fleetserve.platform.api_types import ApiRequest, Endpoint, RoutingHints
from fleetserve.router.replica import serve_adapter
from fleetserve.router.replica.serve_adapter import FleetserveRequestRouter


def router(**routing) -> FleetserveRequestRouter:
    # Serve builds routers with its own plumbing; the state under test is initialize_state's.
    built = FleetserveRequestRouter.__new__(FleetserveRequestRouter)
    built.initialize_state(routing={"policy": "cache_aware", **routing})
    return built


def replica(replica_id: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=replica_id), routing_stats={})


def pending(internal_id: str, adapter: str | None = "a") -> SimpleNamespace:
    request = ApiRequest(f"req-{internal_id}", Endpoint.COMPLETIONS, b"{}",
                         routing=RoutingHints(f"prompt {internal_id} " * 20, adapter=adapter))
    return SimpleNamespace(args=[request], metadata=SimpleNamespace(internal_request_id=internal_id),
                           routing_context=SimpleNamespace(should_backoff=False))


def choose(built: FleetserveRequestRouter, request: SimpleNamespace) -> str:
    ranked = asyncio.run(built.choose_replicas([replica("r0"), replica("r1")], request))
    return ranked[0][0].replica_id.unique_id


def test_a_burst_counts_choices_not_yet_accepted():
    built = router(balance_abs_threshold=2, balance_rel_threshold=1.5)
    # No request is accepted yet (Serve reports acceptance a round trip later). The adapter's home r0 takes
    # choices while 0, 1, 2 in flight differ from r1's 0 by at most 2; the fourth sees 3 - 0 > 2: imbalance.
    assert [choose(built, pending(str(i))) for i in range(4)] == ["r0", "r0", "r0", "r1"]


def test_accepted_requests_count_until_completed_and_rejections_never_count():
    built = router()
    first, second = pending("1"), pending("2")
    choose(built, first)
    choose(built, second)
    built.on_request_routed(first, SimpleNamespace(unique_id="r0"), None)
    # second was rejected by r0: Serve completes it without routing it, and routes it again later.
    built.on_request_completed(SimpleNamespace(unique_id="r0"), "2")
    assert built._num_in_flight() == {"r0": 1}
    built.on_request_completed(SimpleNamespace(unique_id="r0"), "1")
    assert built._num_in_flight() == {}  # nothing in flight anywhere


def test_a_choice_never_accepted_expires(monkeypatch):
    built = router()
    choose(built, pending("lost"))
    assert built._num_in_flight() == {"r0": 1}
    now = serve_adapter.time.monotonic()
    monkeypatch.setattr(serve_adapter.time, "monotonic", lambda: now + serve_adapter.CHOICE_TTL_S + 1)
    assert built._num_in_flight() == {}


def ranked_ids(built: FleetserveRequestRouter, replicas: list[SimpleNamespace], request: SimpleNamespace) -> list[str]:
    return [group[0].replica_id.unique_id for group in asyncio.run(built.choose_replicas(replicas, request))]


def test_a_replica_whose_engine_died_is_not_offered():
    built = router()
    dead, live = replica("r0"), replica("r1")
    dead.routing_stats = {"kv_cache_usage": 0.0, "engine_dead": True}
    # r0 is the adapter's home and idle, so it would rank first; dead, it is not offered at all.
    assert ranked_ids(built, [dead, live], pending("1")) == ["r1"]


def test_a_retry_avoids_the_replica_that_failed_it_while_another_is_live():
    built = router()
    request = pending("1")
    request.args[0] = request.args[0].avoiding("r0")
    assert ranked_ids(built, [replica("r0"), replica("r1")], request) == ["r1"]
    # With every candidate dead or avoided, they are all offered: the request fails at once, never hangs.
    both_dead = [replica("r0"), replica("r1")]
    for each in both_dead:
        each.routing_stats = {"engine_dead": True}
    assert sorted(ranked_ids(built, both_dead, pending("2"))) == ["r0", "r1"]
