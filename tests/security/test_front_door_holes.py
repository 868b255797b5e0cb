"""The front door's limits hold however a request is shaped: the effective output budget is what limits
check and rate limits charge, a refused request is charged nothing, a body is bounded as it streams, and
every response is counted. On a fake engine (no Ray); the rate limiter's clock is frozen, so every
bucket level below is exact."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.config import AuthConfig, LimitsConfig, ModelConfig

KEY, ADMIN_KEY = "sk-tenant-0001", "sk-admin-0002"
TOKENS_PER_MINUTE = 600


def ingress(engine_cls, max_model_len: int | None = None, requests_per_minute: float | None = None,
            **limits) -> tuple[OpenAIIngress, EngineServer]:
    model = ModelConfig(name="fake", source="unused", engine_args={"max_model_len": max_model_len})
    server = EngineServer(model, engine_cls=engine_cls, model_path="/unused")
    auth = AuthConfig.model_validate({
        "tenants": {"t": {"tokens_per_minute": TOKENS_PER_MINUTE, "requests_per_minute": requests_per_minute},
                    "ops": {}},
        "api_keys": [{"sha256": hash_key(KEY), "tenant": "t"}, {"sha256": hash_key(ADMIN_KEY), "tenant": "ops",
                                                                "admin": True}]})
    app = OpenAIIngress({"fake": LocalModelClient(server)}, models={"fake": model},
                        front_door=FrontDoor(auth, clock=lambda: 0.0), limits=LimitsConfig(**limits))
    return app, server


def http(app: OpenAIIngress, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app.build_app()), base_url="http://test",
                             headers=headers, timeout=30)


def tokens_left(app: OpenAIIngress) -> float:
    return app.front_door.limiter._bucket("t", "tokens", TOKENS_PER_MINUTE).level


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello"}]}


async def test_a_request_without_max_tokens_gets_the_platform_limit_and_is_charged_it(fake_engine_cls):
    app, server = ingress(fake_engine_cls, max_tokens=8)
    async with http(app) as client:
        reply = await client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200, reply.text
    # The engine got the limit as the request's budget, and generated exactly that many tokens.
    assert server.engine.bodies[-1]["max_completion_tokens"] == 8
    assert reply.json()["usage"]["completion_tokens"] == 8
    # Charged ceil(5 characters / 4) = 2 prompt tokens + the 8-token budget, not the 256 default.
    assert tokens_left(app) == TOKENS_PER_MINUTE - 10


async def test_without_a_limit_the_charge_is_what_the_context_leaves(fake_engine_cls):
    app, _ = ingress(fake_engine_cls, max_model_len=64)
    async with http(app) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    # The engine may generate up to max_model_len - prompt: 64 - 2 = 62, charged with the 2 prompt tokens.
    assert tokens_left(app) == TOKENS_PER_MINUTE - 64


async def test_a_request_that_generates_nothing_is_charged_its_prompt_alone(fake_engine_cls):
    app, _ = ingress(fake_engine_cls, max_model_len=64, max_tokens=8)
    async with http(app) as client:
        assert (await client.post("/tokenize", json={"model": "fake", "prompt": "hello"})).status_code == 200
    # ceil(5 characters / 4) = 2 prompt tokens; before, also the 8-token output budget it never uses.
    assert tokens_left(app) == TOKENS_PER_MINUTE - 2


async def test_each_of_n_outputs_is_charged_the_budget(fake_engine_cls):
    app, _ = ingress(fake_engine_cls)
    async with http(app) as client:
        assert (await client.post("/v1/chat/completions", json={**CHAT, "n": 3, "max_tokens": 8})).status_code == 200
    # 2 prompt tokens + 3 outputs x 8 tokens; before, n was free: 2 + 8.
    assert tokens_left(app) == TOKENS_PER_MINUTE - 26


async def test_a_request_the_engine_refuses_is_charged_nothing(fake_engine_cls):
    app, _ = ingress(fake_engine_cls, requests_per_minute=1)
    async with http(app) as client:
        # 1 prompt token + 100 > the fake engine's 64-token context: vLLM's 400, relayed.
        refused = await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 100})
        assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
        assert tokens_left(app) == TOKENS_PER_MINUTE
        # The one request per minute was given back too: this one is admitted.
        ok = await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
    # ceil(1 / 4) = 1 prompt token + 2.
    assert tokens_left(app) == TOKENS_PER_MINUTE - 3


async def test_a_request_refused_at_admission_is_charged_nothing(fake_engine_cls):
    app, _ = ingress(fake_engine_cls, max_in_flight_per_replica=1)
    app.work.in_flight["fake"] = 1  # the one slot is taken
    async with http(app) as client:
        refused = await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
    assert tokens_left(app) == TOKENS_PER_MINUTE


async def test_a_chunked_body_is_bounded_as_it_streams(fake_engine_cls):
    app, server = ingress(fake_engine_cls, max_body_bytes=1000)

    async def chunks():
        # No Content-Length: 3 chunks of 600 bytes, refused once the second passes 1000.
        yield b'{"model": "fake", "prompt": "' + b"x" * 571
        yield b"x" * 600
        yield b"x" * 598 + b'"}'

    async with http(app) as client:
        response = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large"
    assert server.engine.bodies == []


async def test_refusals_before_routing_are_counted(fake_engine_cls):
    app, _ = ingress(fake_engine_cls, max_body_bytes=1000)
    async with http(app, key=None) as anonymous:
        assert (await anonymous.post("/v1/completions", json={"model": "fake", "prompt": "x"})).status_code == 401
    async with http(app) as client:
        too_big = await client.post("/v1/completions", json={"model": "fake", "prompt": "x" * 2000})
        assert too_big.status_code == 400
        assert (await client.post("/v1/completions", json={"model": "fake", "prompt": "x"})).status_code == 200
    async with http(app, key=ADMIN_KEY) as admin:
        text = (await admin.get("/metrics")).text
    counts = {(sample.labels["model"], sample.labels["status"]): sample.value
              for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == "fleetserve_requests_total" and sample.labels["route"] == "/v1/completions"}
    assert counts == {("unknown", "401"): 1, ("unknown", "400"): 1, ("fake", "200"): 1}
