"""Browser code on another origin: server.cors answers preflights before auth, and every response it allows (a 401
included) says so and exposes the routing and rate-limit headers. vLLM server flags a replica cannot honour are
refused in a model's api section. The ingress runs on a loopback port with the injected fake engine."""

from __future__ import annotations

import httpx
import pytest

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.config import AuthConfig, ConfigError, CorsConfig, ModelConfig, parse_config

APP = "https://chat.example.com"
KEY = "sk-browser-0001"
BODY = {"model": "small", "prompt": "a b c", "max_tokens": 2}
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def ingress(fake_engine_cls, cors: CorsConfig | None) -> OpenAIIngress:
    server = EngineServer(ModelConfig(name="small", source="unused"), engine_cls=fake_engine_cls, model_path="/unused")
    auth = AuthConfig.model_validate({"tenants": {"web": {"requests_per_minute": 60}},
                                      "api_keys": [{"sha256": hash_key(KEY), "tenant": "web"}]})
    return OpenAIIngress({"small": LocalModelClient(server)}, front_door=FrontDoor(auth), cors=cors)


@pytest.fixture
def endpoint(fake_engine_cls, loopback_server):
    with loopback_server(ingress(fake_engine_cls, CorsConfig(allowed_origins=[APP])).build_app()) as server:
        yield server.url


def test_a_preflight_is_answered_before_auth_for_an_allowed_origin(endpoint):
    preflight = httpx.options(f"{endpoint}/v1/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "POST" in preflight.headers["access-control-allow-methods"]
    refused = httpx.options(f"{endpoint}/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_responses_to_an_allowed_origin_expose_routing_and_rate_limit_headers(endpoint):
    reply = httpx.post(f"{endpoint}/v1/completions", json=BODY,
                       headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == APP
    exposed = {name.strip() for name in reply.headers["access-control-expose-headers"].split(",")}
    assert {"x-fleetserve-model", "x-request-id", "x-ratelimit-remaining-requests", "retry-after", "x-fleetserve-route",
            "x-fleetserve-win-rate", "x-fleetserve-domain-distance"} <= exposed
    assert reply.headers["x-ratelimit-remaining-requests"] == "59"  # 60 a minute, one spent
    # A refusal carries them too, so browser code can read why.
    keyless = httpx.post(f"{endpoint}/v1/completions", json=BODY, headers={"Origin": APP})
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == APP


def test_without_cors_no_origin_is_allowed(fake_engine_cls, loopback_server):
    with loopback_server(ingress(fake_engine_cls, None).build_app()) as server:
        preflight = httpx.options(f"{server.url}/v1/completions", headers=PREFLIGHT)
        reply = httpx.post(f"{server.url}/v1/completions", json=BODY,
                           headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert preflight.status_code == 401 and "access-control-allow-origin" not in preflight.headers
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers


@pytest.mark.parametrize(("data", "expected"), [
    ({"server": {"cors": {"allowed_origins": ["*"], "allow_credentials": True}}}, "name the origins"),
    ({"server": {"cors": {"allowed_origins": []}}}, "server.cors.allowed_origins"),
    ({"models": [{"name": "m", "source": "x", "api": {"extra": {"allowed_origins": [APP]}}}]},
     "allowed_origins: CORS is answered at the front door: use server.cors"),
    ({"models": [{"name": "m", "source": "x", "api": {"extra": {"api_key": "sk-x"}}}]},
     "api_key: API keys are checked at the front door: use the auth section"),
    ({"models": [{"name": "m", "source": "x", "api": {"extra": {"port": 9000, "root_path": "/x"}}}]},
     "port: an option of the HTTP server `vllm serve` runs"),
])
def test_cors_config_errors_and_server_flags_a_replica_cannot_honour(data, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config({"models": [{"name": "m", "source": "x"}], **data})
