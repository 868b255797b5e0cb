"""Request limits, admission control and progress timeouts at the ingress, on a fake engine (no Ray)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress import LocalModelClient, OpenAIIngress
from fleetserve.platform.config import LimitsConfig, ModelConfig


def ingress(engine_cls, **limits) -> tuple[OpenAIIngress, EngineServer]:
    server = EngineServer(ModelConfig(name="fake", source="unused"), engine_cls=engine_cls, model_path="/unused")
    return OpenAIIngress({"fake": LocalModelClient(server)}, limits=LimitsConfig(**limits)), server


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app.build_app()), base_url="http://test", timeout=30)


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"messages": [{"role": "user", "content": "x"}] * 4}, "too_many_messages", "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9}, "max_tokens_too_large", "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 101}]}, "prompt_too_long", "messages"),
])
async def test_each_request_limit_is_a_clear_400(fake_engine_cls, body, code, param):
    app, _ = ingress(fake_engine_cls, max_messages=3, max_tokens=8, max_prompt_chars=100)
    async with http(app) as client:
        response = await client.post("/v1/chat/completions", json={"model": "fake", **body})
        ok = await client.post("/v1/chat/completions", json={"model": "fake", "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "x"}]})
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, code, param)
    assert ok.status_code == 200


async def test_oversized_body_is_refused_before_parsing(fake_engine_cls):
    app, _ = ingress(fake_engine_cls, max_body_bytes=1000)
    async with http(app) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "x " * 600})
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large"


async def test_beyond_admission_bound_is_503_with_retry_after_and_admitted_ones_complete(fake_engine_cls):
    class Slow(fake_engine_cls):
        token_interval_s = 0.05

    # 1 replica x 3 in flight: of 5 simultaneous requests, 3 run and 2 are refused at once.
    app, server = ingress(Slow, max_in_flight_per_replica=3)
    async with http(app) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": "fake", "prompt": "a", "max_tokens": 10}) for _ in range(5)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 200, 200, 503, 503]
        refused = [r for r in responses if r.status_code == 503]
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded" for r in refused)
        # Admitted requests ran to the end; nothing is left counted or running, and new requests get in.
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses if r.status_code == 200)
        assert app.in_flight == {"fake": 0} and server.engine.running == set()
        assert (await client.post("/v1/completions", json={"model": "fake", "prompt": "a"})).status_code == 200


async def test_request_without_progress_is_aborted_and_reported(fake_engine_cls):
    class Stuck(fake_engine_cls):
        first_token_s = 0.2
        token_interval_s = 5.0

    app, server = ingress(Stuck, progress_timeout_s=0.5)
    async with http(app) as client:
        blocking = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3})
        streamed = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3,
                                                               "stream": True})
    # The first token came (0.2 s < 0.5 s); the second never did within 0.5 s.
    assert blocking.status_code == 504 and blocking.json()["error"]["code"] == "no_progress"
    assert '"code":"no_progress"' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    # Both were aborted in the engine and are no longer counted.
    assert len(server.engine.aborted) == 2 and server.engine.running == set() and app.in_flight == {"fake": 0}
