"""Serve's own queue in front of the ingress is bounded: once every ingress slot is taken and the proxy's
queue is full, the proxy answers 503 with Retry-After at once instead of queueing without bound."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleetserve.platform.config import parse_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bounded_app(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.instant_engine import InstantEngine

    config = parse_config({"models": [{"name": "instant", "source": "tiny-random-llama",
                                       "resources": {"num_cpus": 0.1}}],
                           "limits": {"ingress_max_ongoing_requests": 1, "ingress_max_queued_requests": 1,
                                      "ingress_retry_after_s": 2}})
    # A token every 10 ms, so a stream holds its slot as long as an engine would, however fast the path.
    serve.run(build_app(config, engine_cls=InstantEngine.paced(0.01)), name="bounded", route_prefix="/bounded")
    yield f"{served.base_url}/bounded"
    serve.delete("bounded")


async def test_beyond_the_ingress_and_its_queue_the_proxy_refuses_with_retry_after(bounded_app):
    # Each stream of 300 tokens holds the one ingress slot for at least 3 s (300 x 10 ms): of 6 sent at once,
    # 1 streams, 1 waits in the proxy's queue, 4 are refused.
    body = {"model": "instant", "max_tokens": 300, "stream": True, "messages": [{"role": "user", "content": "x"}]}

    async def send(http: httpx.AsyncClient, delay_s: float) -> httpx.Response:
        await asyncio.sleep(delay_s)
        response = await http.post(f"{bounded_app}/v1/chat/completions", json=body)
        return response

    async with httpx.AsyncClient(timeout=120) as http:
        # The first two a moment ahead, so they hold the slot and the queue when the rest arrive.
        responses = await asyncio.gather(*[send(http, 0.0 if index < 2 else 0.5) for index in range(6)])
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [200, 200, 503, 503, 503, 503]
    assert {response.headers.get("retry-after") for response in responses if response.status_code == 503} == {"2"}
    # The admitted streams ran to the end: 300 token events and [DONE].
    for response in responses:
        if response.status_code == 200:
            assert response.text.count("data: ") == 301
