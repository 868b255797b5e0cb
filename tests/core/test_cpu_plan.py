"""CPU binding: engines get disjoint cores while there are enough, and share evenly when not."""

import pytest

from fleetserve.deployments.builders import cpu_bindings_per_deployment
from fleetserve.platform.config import parse_config
from fleetserve.platform.engine import plan_cpu_binding, split_binding


@pytest.mark.parametrize(("num_engines", "num_cores", "expected"), [
    (1, 2, ["0-1"]),
    (2, 2, ["0", "1"]),
    (3, 2, ["0", "1", "0"]),           # more engines than cores: round-robin
    (3, 8, ["0-1", "2-3", "4-7"]),     # 8 // 3 = 2 cores each; the last takes the remainder
    (0, 4, []),
])
def test_plan_cpu_binding(num_engines, num_cores, expected):
    assert plan_cpu_binding(num_engines, num_cores) == expected


def test_bindings_spread_over_models_and_respect_explicit_ones():
    config = parse_config({"models": [
        {"name": "a", "source": "x", "replicas": 2},
        {"name": "b", "source": "x", "resources": {"cpu_binding": ["7"]}},
        {"name": "c", "source": "x"},
        {"name": "g", "source": "x", "resources": {"num_gpus": 1}},
    ]})
    # a (2 replicas) and c share the 4 cores: 3 engines -> 1, 1, 2 cores.
    assert cpu_bindings_per_deployment(config, num_cores=4) == {
        "engine-a": ["0", "1"], "engine-b": ["7"], "engine-c": ["2-3"], "engine-g": None}


def test_bindings_cover_both_pools_of_a_disaggregated_model():
    config = parse_config({"models": [
        {"name": "pd", "source": "x", "disaggregation": {"prefill": {"replicas": 2}, "decode": {"cpu_binding": ["5"]}}},
        {"name": "c", "source": "x"},
    ]})
    # 2 prefill replicas + c = 3 automatic engines on 6 cores -> 2 cores each; decode keeps its own.
    assert cpu_bindings_per_deployment(config, num_cores=6) == {
        "prefill-pd": ["0-1", "2-3"], "engine-pd": ["5"], "engine-c": ["4-5"]}


def test_each_tensor_parallel_rank_gets_its_own_cores():
    config = parse_config({"models": [
        {"name": "tp", "source": "x", "replicas": 2, "engine_args": {"tensor_parallel_size": 2}},
        {"name": "c", "source": "x"},
    ]})
    # 2 replicas x 2 ranks + c = 5 workers on 8 cores: 8 // 5 = 1 core each, the last takes the remaining 4.
    assert cpu_bindings_per_deployment(config, num_cores=8) == {"engine-tp": ["0|1", "2|3"], "engine-c": ["4-7"]}


@pytest.mark.parametrize(("binding", "num_ranks", "expected"), [
    ("0-3", 2, "0-1|2-3"),
    ("0-4", 2, "0-2|3-4"),       # 5 cores over 2 ranks: the first takes the extra one
    ("0,2,4,6", 2, "0,2|4,6"),   # a list that is not a range stays a list
    ("0", 2, "0|0"),             # fewer cores than ranks: they share
    ("0-1|2-3", 2, "0-1|2-3"),   # already one set per rank
    ("5", 1, "5"),
])
def test_one_binding_splits_between_ranks(binding, num_ranks, expected):
    assert split_binding(binding, num_ranks) == expected


def test_a_pool_that_starts_at_zero_has_cores_for_the_replica_that_wakes_it():
    zero = {"replicas": 0, "autoscaling": {"policy": "kv_cache", "min_replicas": 0, "max_replicas": 2}}
    config = parse_config({"models": [{"name": "z", "source": "x", **zero}, {"name": "c", "source": "x"}]})
    # z counts as one engine beside c: 2 engines on 4 cores -> 2 cores each.
    assert cpu_bindings_per_deployment(config, num_cores=4) == {"engine-z": ["0-1"], "engine-c": ["2-3"]}
