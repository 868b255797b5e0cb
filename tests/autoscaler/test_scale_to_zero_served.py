"""A pool with min_replicas 0 on a real Serve deployment: it starts at zero (replicas: 0), a request wakes it,
idle takes it back to zero, held requests wake it, and requests past the hold limit get a 503 with Retry-After
at once."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import cluster_helpers
from cluster_helpers import wait_for
from factories import model_entry

pytestmark = pytest.mark.slow
MODEL = "tiny-zero"
MAX_HELD = 3


@pytest.fixture(scope="module")
def zero_app(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import parse_config

    config = parse_config({"models": [{**model_entry(MODEL), "resources": {"num_cpus": 0.1, "cpu_binding": ["0"]},
                                       "replicas": 0, "autoscaling": {
                                           "policy": "kv_cache", "min_replicas": 0, "max_replicas": 1,
                                           "idle_to_zero_s": 3, "scale_down_cooldown_s": 0,
                                           "downscale_stabilization_s": 0, "decision_period_s": 0.5,
                                           "metrics_interval_s": 0.5, "max_held_requests": MAX_HELD,
                                           "hold_timeout_s": 240}}]})
    serve.run(build_app(config), name="zero", route_prefix="/zero")
    yield f"{served.base_url}/zero"
    serve.delete("zero")


def running_replicas() -> int:
    return cluster_helpers.running_replicas("zero", f"engine-{MODEL}")


def series_value(url: str, series: str) -> int:
    """One series of the ingress's /metrics, 0 when absent."""
    found = re.search(re.escape(series) + r" ([0-9.]+)", httpx.get(f"{url}/metrics", timeout=10).text)
    return int(float(found.group(1))) if found else 0


def reporting_replicas(url: str) -> int:
    """Replicas the ingress sees (those publishing to the metrics hub)."""
    return series_value(url, f'fleetserve_replicas{{model="{MODEL}",pool="colocated"}}')


def cold_starts(url: str) -> int:
    return series_value(url, f'fleetserve_cold_start_seconds_count{{model="{MODEL}"}}')


def test_a_pool_at_zero_wakes_for_held_requests_and_goes_back_to_zero(zero_app):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    # Deployed with replicas: 0, the pool starts no engine; the first request wakes it (and starts the ingress's
    # reading of engine load).
    assert running_replicas() == 0
    assert httpx.post(f"{zero_app}/v1/completions", json=body, timeout=240).status_code == 200
    wait_for(lambda: running_replicas() == 0, 180, "idle to take the pool to zero")
    wait_for(lambda: reporting_replicas(zero_app) == 0, 30, "the ingress to see no replica")
    time.sleep(1)  # two of the ingress's load readings (every 0.5 s)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            tasks = []
            for index in range(MAX_HELD + 2):
                tasks.append(asyncio.create_task(http.post(f"{zero_app}/v1/completions",
                                                           json={**body, "prompt": f"hello {index}"})))
                await asyncio.sleep(0.2)  # arrival order
            return await asyncio.gather(*tasks)

    num_cold_starts = cold_starts(zero_app)
    started = time.monotonic()
    responses = asyncio.run(burst())
    cold_start_s = time.monotonic() - started
    # The first MAX_HELD wait for the cold start and are served; the rest are refused at once.
    assert [r.status_code for r in responses] == [200] * MAX_HELD + [503, 503], [r.text for r in responses]
    for refused in responses[MAX_HELD:]:
        assert refused.json()["error"]["code"] == "cold_start_full"
        assert int(refused.headers["retry-after"]) >= 1
    assert cold_starts(zero_app) == num_cold_starts + 1, cold_start_s
    text = httpx.get(f"{zero_app}/metrics", timeout=10).text
    assert re.search(rf'fleetserve_admission_rejections_total{{bound="cold_start_full",model="{MODEL}"}} 2\.0', text)
    assert running_replicas() == 1
    wait_for(lambda: running_replicas() == 0, 180, "idle to take the pool back to zero")
