"""CPU binding: engines get disjoint cores while there are enough, and share evenly when not."""

import pytest

from fleetserve.deployments.builders import cpu_bindings_per_deployment
from fleetserve.platform.config import parse_config
from fleetserve.platform.engine import plan_cpu_binding


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
