"""The whole Serve path (proxy, ingress, engine deployment, metrics hub) on an injected engine: the
deployments take their engine class, so Serve-level behaviour is testable without vLLM's weights."""

from __future__ import annotations

import httpx
import pytest

from fleetserve.platform.config import parse_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def instant_app(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.instant_engine import InstantEngine

    config = parse_config({"models": [{"name": "instant", "source": "tiny-random-llama",
                                       "resources": {"num_cpus": 0.1}}]})
    serve.run(build_app(config, engine_cls=InstantEngine), name="instant", route_prefix="/instant")
    yield f"{served.base_url}/instant"
    serve.delete("instant")


def test_an_injected_engine_serves_through_serve(instant_app):
    body = {"model": "instant", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(f"{instant_app}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    # InstantEngine writes " t" per token: 5 tokens.
    assert reply.json()["choices"][0]["message"]["content"] == " t" * 5
    assert reply.headers["x-fleetserve-model"] == "instant" and reply.headers["x-fleetserve-pool"] == "colocated"
    with httpx.stream("POST", f"{instant_app}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    # 5 token events, then [DONE]; the usage event the ingress asked for (not the client) is dropped.
    assert len(events) == 6 and events[-1] == "data: [DONE]"
    assert all('"usage"' not in event for event in events)
