"""Requests held while a pool wakes from zero replicas: the bound, the order, the timeout (no Ray)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleetserve.deployments.ingress.cold_start import DEFAULT_COLD_START_S, ColdStartHold
from fleetserve.deployments.ingress.metrics import IngressMetrics
from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.config import ModelConfig


def hold(**autoscaling) -> ColdStartHold:
    model = ModelConfig.model_validate({"name": "m", "source": "x", "autoscaling": {"min_replicas": 0,
                                                                                   **autoscaling}})
    always_on = ModelConfig.model_validate({"name": "on", "source": "x", "autoscaling": {"min_replicas": 1}})
    return ColdStartHold({"m": model, "on": always_on}, IngressMetrics())


def test_only_pools_that_scale_to_zero_are_held():
    cold = hold()
    assert cold.scales_to_zero("m") and not cold.scales_to_zero("on")


async def test_held_requests_go_on_in_arrival_order_once_the_first_is_answered():
    cold = hold()
    entered: list[int] = []
    first_answered = asyncio.Event()

    async def request(index: int) -> None:
        async with cold.held("m"):
            entered.append(index)
            if index == 0:
                await first_answered.wait()  # the wake-up: its first token

    tasks = [asyncio.create_task(request(i)) for i in range(4)]
    await asyncio.sleep(0.05)
    assert entered == [0] and cold.num_held["m"] == 4  # the others wait for the pool
    first_answered.set()
    await asyncio.gather(*tasks)
    assert entered == [0, 1, 2, 3] and cold.num_held["m"] == 0


async def test_requests_past_the_hold_limit_get_503_with_retry_after():
    cold = hold(max_held_requests=2)
    answered = asyncio.Event()

    async def first() -> None:
        async with cold.held("m"):
            await answered.wait()

    async def second() -> None:
        async with cold.held("m"):
            pass

    tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
    await asyncio.sleep(0.05)
    with pytest.raises(APIError) as caught:
        async with cold.held("m"):
            pass
    assert (caught.value.status_code, caught.value.code) == (503, "cold_start_full")
    # No cold start measured yet: the default, less the ~0.05 s elapsed, rounded up.
    assert caught.value.headers == {"Retry-After": str(int(DEFAULT_COLD_START_S))}
    answered.set()
    await asyncio.gather(*tasks)


async def test_a_held_request_times_out_with_503_and_the_cold_start_is_measured():
    cold = hold(hold_timeout_s=0.1)
    answered = asyncio.Event()

    async def first() -> None:
        async with cold.held("m"):
            await asyncio.sleep(0.3)  # the pool takes 0.3 s to answer
            answered.set()

    task = asyncio.create_task(first())
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as caught:
        async with cold.held("m"):
            pass
    assert (caught.value.status_code, caught.value.code) == (503, "cold_start_timeout")
    await task
    assert cold.cold_start_s["m"] >= 0.3  # from the first request held to its answer
    # Measured 0.3 s: the next refusal's Retry-After is its remainder, at least 1 s.
    assert cold.refusal("m", "x", "cold_start_full").headers == {"Retry-After": "1"}


def test_zero_knobs_refused_on_a_pool_that_never_reaches_zero():
    from fleetserve.platform.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="act only on a pool that scales to zero"):
        parse_config({"models": [{"name": "m", "source": "x", "autoscaling": {"max_held_requests": 4}}]})


async def test_a_burst_before_the_first_load_reading_is_held_and_bounded():
    from fake_engine import FakeEngine

    from fleetserve.deployments.engine_server import EngineServer
    from fleetserve.deployments.ingress.model_clients import LocalModelClient
    from fleetserve.deployments.ingress.server import OpenAIIngress
    from fleetserve.platform.config import ModelConfig

    class SlowStart(FakeEngine):
        first_token_s = 0.5

    model = ModelConfig.model_validate({"name": "z", "source": "x", "replicas": 0, "autoscaling": {
        "min_replicas": 0, "max_held_requests": 1}})
    readings: list[int] = []

    async def loads() -> dict:
        readings.append(1)
        return {"z": []}  # the pool at zero: no replica reports

    server = EngineServer(model, engine_cls=SlowStart, model_path="/unused")
    app = OpenAIIngress({"z": LocalModelClient(server)}, models={"z": model}, load_source=loads)
    transport = httpx.ASGITransport(app=app.build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
        body = {"model": "z", "prompt": "hi", "max_tokens": 2}
        responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(3)))
    # Sent before the ingress had read any engine load: before, all three went on unheld (3 x 200). Now they
    # wait for the first reading, which shows the pool at zero: one is held (max_held_requests 1), two refused.
    assert sorted(r.status_code for r in responses) == [200, 503, 503]
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 503} == {"cold_start_full"}
    assert readings
