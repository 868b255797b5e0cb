"""Cache-aware routing with two real replicas: groups stick to a replica and the engines' prefix cache hits more."""

import random
from collections import defaultdict

import httpx
import pytest

from fleetserve.loadtest.datasets import PromptMaker, shared_prefix_dataset
from fleetserve.platform.config import parse_config

ROUTE_PREFIX = "/routing"


@pytest.fixture(scope="module")
def routing_app(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app

    two_replicas = {"replicas": 2, "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]},
                    "engine_args": {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 64 * 2**20}}
    config = parse_config({"models": [
        {"name": "tiny-cache-aware", "source": "tiny-random-llama", **two_replicas,
         "routing": {"policy": "cache_aware"}},
        {"name": "tiny-default", "source": "tiny-random-llama", **two_replicas,
         "routing": {"policy": "power_of_two"}},
    ]})
    serve.run(build_app(config), name="routing", route_prefix=ROUTE_PREFIX)
    yield f"{served.base_url}{ROUTE_PREFIX}/v1"
    serve.delete("routing")


def send_workload(url: str, model: str) -> tuple[dict[int, set[str]], list[str], float]:
    # 8 groups x 4 requests, sequential so load never overrides affinity. Each prompt: ~400 shared words + 10 own.
    specs = shared_prefix_dataset(32, num_groups=8, prefix_len=300, suffix_len=10, output_len=2,
                                  maker=PromptMaker(None, random.Random(0)))
    replicas_by_group, reasons = defaultdict(set), []
    prompt_tokens = cached_tokens = 0
    with httpx.Client(timeout=120) as http:
        for spec in specs:
            response = http.post(f"{url}/completions", json={"model": model, "prompt": spec.prompt, "max_tokens": 2})
            assert response.status_code == 200, response.text
            replicas_by_group[spec.group_id].add(response.headers["x-fleetserve-replica"])
            reasons.append(response.headers.get("x-fleetserve-route-reason"))
            usage = response.json()["usage"]
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    # The engines' own count: prompt tokens served from their prefix caches.
    return replicas_by_group, reasons, cached_tokens / prompt_tokens


def test_cache_aware_keeps_groups_together_and_raises_engine_hit_rate(routing_app):
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
