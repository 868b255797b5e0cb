"""A prefill pool that scales to zero, on a real Serve deployment: it starts at zero (as it would be after idling
there), the first prompt is prefilled on the decode replica, and that replica's wake call brings the pool up for
the prompts after it. Before the wake call the pool stayed at zero for good: nothing else reaches a prefill pool."""

from __future__ import annotations

import time

import httpx
import pytest

from cluster_helpers import wait_until_healthy
from factories import model_entry

pytestmark = [pytest.mark.slow]
pytest.importorskip("nixl", reason="disaggregation needs nixl (make install adds it)")

MODEL = "pd-wake"
PREFILL = f"prefill-{MODEL}"
DECODE = f"engine-{MODEL}"


@pytest.fixture(scope="module")
def pd_wake(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import parse_config

    # Every prompt goes to the prefill pool while it runs (min_prompt_tokens 0); it starts with no replica.
    prefill = {"replicas": 0, "cpu_binding": ["0"], "autoscaling": {
        "policy": "kv_cache", "min_replicas": 0, "max_replicas": 1, "idle_to_zero_s": 5, "scale_down_cooldown_s": 1,
        "downscale_stabilization_s": 0, "decision_period_s": 0.5, "metrics_interval_s": 0.5}}
    # The decode pool starts at zero too: the first request waits while Serve starts it.
    decode = {"replicas": 0, "cpu_binding": ["1"], "autoscaling": {
        "policy": "kv_cache", "min_replicas": 0, "max_replicas": 1, "idle_to_zero_s": 600}}
    config = parse_config({"models": [{
        **model_entry(MODEL), "resources": {"num_cpus": 0.1},
        "disaggregation": {"min_prompt_tokens": 0, "prefill": prefill, "decode": decode}}]})
    serve.run(build_app(config), name=MODEL, route_prefix=f"/{MODEL}")
    yield f"{served.base_url}/{MODEL}"
    wait_until_healthy(MODEL)
    serve.delete(MODEL)


def running(deployment: str) -> int:
    from ray import serve

    return serve.status().applications[MODEL].deployments[deployment].replica_states.get("RUNNING", 0)


def wait_for(deployment: str, count: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while running(deployment) != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def prefilled_by(url: str, request_id: str) -> str | None:
    """The prefill replica that computed a completion's prompt, or None where the decode replica did."""
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": f"{request_id}: a prompt for the prefill pool", "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    return reply.headers.get("x-fleetserve-prefill-replica")


def test_a_prefill_pool_at_zero_is_woken_by_the_prompt_that_finds_it_empty(pd_wake):
    assert running(PREFILL) == 0 and running(DECODE) == 0
    # The pool is empty: the decode replica prefills this prompt itself, and asks the pool for a replica.
    assert prefilled_by(pd_wake, "first") is None
    assert wait_for(PREFILL, 1, timeout_s=180), "the prefill pool stayed at zero"
    assert prefilled_by(pd_wake, "second") is not None
