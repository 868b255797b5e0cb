"""Replica selection policies on hand-built replica states, with exact expected choices."""

import pytest

from fleetserve.platform.config import ConfigError, RoutingConfig, parse_config
from fleetserve.router.replica.prefix_index import PrefixIndex, block_hashes
from fleetserve.router.replica.policy import (
    CacheAwarePolicy,
    CacheAwareThresholds,
    NoReplicaError,
    PowerOfTwoPolicy,
    ReplicaLoad,
    RoundRobinPolicy,
    SessionAffinityPolicy,
    make_policy,
)

BLOCK = 8  # characters per block in these tests
SYSTEM = "A" * 32  # 4 blocks of shared prefix


def loads(**outstanding: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id, count) for replica_id, count in outstanding.items()]


def policy(**thresholds) -> CacheAwarePolicy:
    return CacheAwarePolicy(CacheAwareThresholds(**thresholds), PrefixIndex(block_chars=BLOCK, capacity_blocks=64))


def test_block_hashes_are_chained_and_skip_the_partial_tail():
    # 20 chars = 2 full blocks of 8, tail of 4 not hashed.
    assert len(block_hashes("x" * 20, 8)) == 2
    # Same second block after a different first block hashes differently: a prefix, not a bag of blocks.
    assert block_hashes("aaaaaaaabbbbbbbb", 8)[1] != block_hashes("ccccccccbbbbbbbb", 8)[1]


def test_prefix_hit_beats_load_within_the_thresholds():
    router = policy(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.5)
    first = router.choose(SYSTEM + "q1", loads(r0=0, r1=0))
    assert (first.replica_id, first.reason) == ("r0", "load")  # nothing cached yet: least loaded, ties by id
    # r0 now holds the 4 prefix blocks. It is busier (3 vs 0) but the gap 3 is within the absolute bound 4.
    second = router.choose(SYSTEM + "q2 another question", loads(r0=3, r1=0))
    # Prompt: 32 + 19 = 51 chars -> 6 full blocks; r0 holds the first 4: ratio 4/6 = 0.67 >= 0.5.
    assert (second.replica_id, second.reason) == ("r0", "cache_hit")
    assert second.match_ratio == pytest.approx(4 / 6)


def test_imbalance_overrides_the_hit():
    router = policy(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.5)
    router.choose(SYSTEM, loads(r0=0, r1=0))
    # 10 - 2 = 8 > 4 and 10 > 2 x 1.5: imbalanced, so the least loaded r1 wins despite r0's full match.
    decision = router.choose(SYSTEM, loads(r0=10, r1=2))
    assert (decision.replica_id, decision.reason, decision.match_ratio) == ("r1", "imbalance", 0.0)


def test_both_imbalance_bounds_must_be_exceeded():
    router = policy(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.5)
    router.choose(SYSTEM, loads(r0=0, r1=0))
    # Gap 100 - 90 = 10 > 4 but 100 < 90 x 1.5: balanced enough, so the cache hit stands.
    assert router.choose(SYSTEM, loads(r0=100, r1=90)).reason == "cache_hit"


def test_low_match_ratio_falls_back_to_load():
    router = policy(cache_threshold=0.5)
    router.choose("B" * 8, loads(r0=0, r1=0))  # r0 holds one block "BBBBBBBB"
    # New prompt: 4 blocks, only the first matches r0: 1/4 = 0.25 < 0.5 -> least loaded, r1.
    decision = router.choose("B" * 8 + "C" * 24, loads(r0=1, r1=0))
    assert (decision.replica_id, decision.reason) == ("r1", "load")


def test_new_prefixes_spread_to_the_replica_caching_least():
    router = policy()
    # Both idle: r0 (id order) takes the first prefix; the next new prefix goes to r1, which caches nothing.
    assert router.choose("P" * 32, loads(r0=0, r1=0)).replica_id == "r0"
    assert router.choose("Q" * 32, loads(r0=0, r1=0)).replica_id == "r1"
    # Now r0 holds 4 blocks and r1 4: a tie again, broken by id; but load still comes first.
    assert router.choose("R" * 32, loads(r0=1, r1=0)).replica_id == "r1"


def test_eviction_forgets_old_prefixes():
    router = CacheAwarePolicy(CacheAwareThresholds(cache_threshold=0.5), PrefixIndex(block_chars=BLOCK, capacity_blocks=4))
    router.choose(SYSTEM, loads(r0=0, r1=5))          # r0 holds SYSTEM's 4 blocks (capacity 4)
    router.choose("Z" * 32, loads(r0=0, r1=5))        # 4 new blocks on r0 evict all of SYSTEM's
    assert router.index.match(router.index.hashes(SYSTEM), ["r0"])[0].num_matched_blocks == 0
    assert router.choose(SYSTEM, loads(r0=1, r1=0)).reason == "load"


def test_unknown_or_dead_replicas_are_never_chosen():
    router = policy()
    router.choose(SYSTEM, loads(r0=0))                # r0 holds the prefix, then dies
    decision = router.choose(SYSTEM, loads(r1=7, r2=3))
    assert decision.replica_id == "r2" and decision.reason == "load"
    router.forget(["r1", "r2"])
    assert router.index.num_blocks("r0") == 0
    with pytest.raises(NoReplicaError):
        router.choose(SYSTEM, [])


def test_session_affinity_keeps_a_conversation_while_its_replica_lives():
    router = SessionAffinityPolicy(policy())
    assert router.choose("hello", loads(r0=0, r1=0), session_id="s1").replica_id == "r0"
    # r0 is much busier now, but session s1 stays there.
    assert router.choose("again", loads(r0=50, r1=0), session_id="s1").reason == "session"
    assert router.choose("again", loads(r0=50, r1=0), session_id="s1").replica_id == "r0"
    # r0 died: the session moves, and then sticks to its new replica.
    moved = router.choose("again", loads(r1=0, r2=1), session_id="s1")
    assert moved.replica_id == "r1" and moved.reason != "session"
    assert router.choose("more", loads(r1=9, r2=0), session_id="s1").replica_id == "r1"


def test_round_robin_and_power_of_two():
    rr = RoundRobinPolicy()
    assert [rr.choose("", loads(b=0, a=9, c=0)).replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    p2 = PowerOfTwoPolicy(seed=0)
    # With two replicas, both are always sampled: the less loaded always wins.
    assert {p2.choose("", loads(r0=5, r1=1)).replica_id for _ in range(20)} == {"r1"}


def test_make_policy_builds_what_routing_names_with_its_thresholds():
    policy = make_policy(RoutingConfig(policy="cache_aware", cache_threshold=0.3))
    assert isinstance(policy, CacheAwarePolicy)
    # The thresholds routing: leaves unset are its own defaults (SGLang's): 32 and 1.5.
    assert policy.thresholds == CacheAwareThresholds(32, 1.5, 0.3) == CacheAwareThresholds(cache_threshold=0.3)
    assert isinstance(make_policy(RoutingConfig(policy="session")), SessionAffinityPolicy)
    assert isinstance(make_policy(RoutingConfig(policy="power_of_two")), PowerOfTwoPolicy)
    with pytest.raises(ConfigError, match="routing.policy: Input should be 'cache_aware'"):
        parse_config({"models": [{"name": "m", "source": "x", "routing": {"policy": "fastest"}}]})


def adapter_loads(**held: tuple[int, set[str]]) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id, count, None, frozenset(names)) for replica_id, (count, names) in held.items()]


def test_adapter_request_goes_to_the_replica_reporting_it():
    router = policy(balance_abs_threshold=4)
    decision = router.choose("<lora:a>hello", adapter_loads(r0=(0, set()), r1=(1, {"a"})), adapter="a")
    # r1 is busier by one, within the thresholds (1 - 0 <= 4): the adapter's holder wins.
    assert (decision.replica_id, decision.reason) == ("r1", "adapter")


def test_adapter_affinity_yields_to_imbalance():
    router = policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    decision = router.choose("<lora:a>hello", adapter_loads(r0=(0, set()), r1=(5, {"a"})), adapter="a")
    # 5 - 0 > 4 and 5 > 0 x 1.5: imbalanced, so the least loaded replica takes it without the adapter.
    assert (decision.replica_id, decision.reason) == ("r0", "imbalance")


def test_adapters_spread_over_replicas_and_stay_home():
    router = policy()
    replicas = adapter_loads(r0=(0, set()), r1=(0, set()))
    first_a = router.choose("<lora:a>one", replicas, adapter="a")
    first_b = router.choose("<lora:b>two", replicas, adapter="b")
    # a goes to r0 by id; b then prefers r1, home to no adapter yet.
    assert [(d.replica_id, d.reason) for d in (first_a, first_b)] == [("r0", "load"), ("r1", "load")]
    # 3 blocks each, of which only the adapter's key block is shared: 1/3 < cache_threshold 0.5, no prefix hit.
    later = [router.choose(f"<lora:{name}>{str(i) * 16}", replicas, adapter=name) for i in range(3) for name in "ab"]
    # With no report yet, each adapter's home is where the router last sent it.
    assert [(d.replica_id, d.reason) for d in later] == [("r0", "adapter"), ("r1", "adapter")] * 3


def test_adapter_home_beats_stale_reports_and_dies_with_its_replica():
    router = policy()
    router.choose("<lora:a>one", adapter_loads(r0=(0, set()), r1=(0, set())), adapter="a")
    # Both engines report holding a (loaded at start); the router's own last choice, r0, is fresher.
    both = adapter_loads(r0=(0, {"a"}), r1=(0, {"a"}))
    assert router.choose("<lora:a>two", both, adapter="a").replica_id == "r0"
    router.forget(["r1"])
    survivor = router.choose("<lora:a>three", adapter_loads(r1=(0, {"a"})), adapter="a")
    assert (survivor.replica_id, survivor.reason) == ("r1", "adapter")


def test_an_adapter_every_replica_holds_spreads_by_load():
    router = policy()
    router.choose("<lora:a>" + "1" * 16, adapter_loads(r0=(0, set()), r1=(0, set())), adapter="a")
    # Both hold a; its home r0 is busier by one: the least loaded holder takes it (1 of 3 blocks shared: no hit).
    decision = router.choose("<lora:a>" + "2" * 16, adapter_loads(r0=(1, {"a"}), r1=(0, {"a"})), adapter="a")
    assert (decision.replica_id, decision.reason) == ("r1", "adapter")


def test_base_model_requests_ignore_adapter_reports():
    router = policy()
    decision = router.choose("hello", adapter_loads(r0=(1, set()), r1=(0, {"a"})))
    assert (decision.replica_id, decision.reason) == ("r1", "load")  # least loaded; adapters play no part
