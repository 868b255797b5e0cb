"""Fuzzed input: schemathesis against the ingress's OpenAPI schema, and hypothesis against validation.

On a fake engine with auth and limits on, so every layer of the front door is in the path. No input may
produce a 5xx or hang, and the server must keep answering normally afterwards.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.platform.config import AuthConfig, LimitsConfig, ModelConfig

schemathesis = pytest.importorskip("schemathesis")
KEY = "sk-fuzz-0001"


def build(engine_cls) -> OpenAIIngress:
    server = EngineServer(ModelConfig(name="fake", source="unused"), engine_cls=engine_cls, model_path="/unused")
    auth = AuthConfig.model_validate({"tenants": {"t": {"requests_per_minute": 1e9}},
                                      "api_keys": [{"sha256": hash_key(KEY), "tenant": "t"}]})
    # Short progress timeout: a request the fake engine cannot finish quickly fails fast instead of hanging.
    return OpenAIIngress({"fake": LocalModelClient(server)}, front_door=FrontDoor(auth),
                         limits=LimitsConfig(progress_timeout_s=5.0))


@pytest.fixture(scope="module")
def app():
    from conftest import FakeEngine

    return build(FakeEngine).build_app()


def test_openapi_schema_fuzz_finds_no_5xx(app):
    # Cases drawn from every operation in the app's own OpenAPI schema (schemathesis's strategies, run
    # under hypothesis directly: its pytest plugin does not load under pytest 9).
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}

    @given(case=st.one_of([op.as_strategy() for op in operations]))
    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code < 500, (case.path, case.body, response.text[:300])
        if response.status_code >= 400:
            assert "error" in response.json()

    fuzz()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream", "n",
          "logprobs", "seed", "stream_options", "user"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
       valid_model=st.booleans())
def test_validation_answers_every_body_with_json_and_no_5xx(app, path, body, valid_model):
    if valid_model:
        body["model"] = "fake"

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            return await client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})

    response = asyncio.run(call())
    assert response.status_code < 500, (body, response.text[:300])
    if response.status_code != 200:
        assert set(response.json()["error"]) >= {"message", "type"}


@pytest.mark.parametrize("raw", [
    b'{"model": "fake", "prompt": "x", "temperature": NaN}',
    b'{"model": "fake", "prompt": "x", "max_tokens": Infinity}',
    b'{"model": "fake", "messages": [{"role": "user", "content": -Infinity}]}',
    b'{"model": "fake", "prompt": "x"',
    b'\xff\xfe not utf-8',
    b'[]',
])
def test_non_standard_json_gets_a_400(app, raw):
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            return await client.post("/v1/completions", content=raw, headers={
                "Authorization": f"Bearer {KEY}", "content-type": "application/json"})

    response = asyncio.run(call())
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
