"""The ingress's OpenAI protocol, on the plain classes with an injected fake engine (no Ray)."""

import json
import time

import httpx
import pytest

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress import LocalModelClient, OpenAIIngress
from fleetserve.platform.config import ModelConfig


@pytest.fixture
def server(fake_engine_cls):
    return EngineServer(ModelConfig(name="fake", source="unused"), engine_cls=fake_engine_cls, model_path="/unused")


@pytest.fixture
async def client(server):
    app = OpenAIIngress({"fake": LocalModelClient(server)}).build_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        yield http


def sse_payloads(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def test_chat_returns_text_usage_and_routing_headers(client):
    response = await client.post("/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "w0 w1 w2"}
    assert body["choices"][0]["finish_reason"] == "length"
    # 3 prompt words -> 3 prompt tokens; 3 generated.
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 6
    assert response.headers["x-fleetserve-model"] == "fake"
    assert response.headers["x-fleetserve-replica"] == "local"
    assert response.headers["x-fleetserve-pool"] == "colocated"
    assert response.headers["x-request-id"] == body["id"]


async def test_stream_ends_with_usage_then_done(client):
    response = await client.post("/v1/completions", json={
        "model": "fake", "prompt": "x", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    # 4 token chunks, then the usage chunk with no choices.
    assert [p["choices"][0]["text"] for p in payloads[:4]] == ["w0", " w1", " w2", " w3"]
    assert payloads[3]["choices"][0]["finish_reason"] == "length"
    assert payloads[4]["choices"] == [] and payloads[4]["usage"]["completion_tokens"] == 4


async def test_stream_without_include_usage_has_no_usage_chunk(client):
    response = await client.post("/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True})
    payloads = sse_payloads(response.text)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": "w0"}
    assert all(p["choices"] for p in payloads)


async def test_stop_string_ends_output_with_stop(client):
    response = await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 10,
                                                          "stop": ["w2"]})
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("w0 w1", "stop")


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"model": "nope", "prompt": "x"}, 404, "model", "The model `nope` does not exist. Available models: fake"),
    ({"model": "fake", "prompt": "x", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ({"model": "fake", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"model": "fake", "prompt": "x", "n": 2}, 400, "n", "less than or equal to 1"),
    ({"model": "fake"}, 400, "prompt", "Field required"),
    ({"model": "fake", "prompt": []}, 400, "prompt", "must not be empty"),
    ({"model": "fake", "prompt": [5, 100000]}, 400, "prompt", "outside the vocabulary (0..999)"),
    # FakeEngine.max_model_len is 64: 2 prompt tokens + 63 = 65 > 64.
    ({"model": "fake", "prompt": "a b", "max_tokens": 63}, 400, "max_tokens",
     "maximum context length is 64 tokens. However, you requested 65 tokens (2 in the prompt, 63 for the completion)"),
])
async def test_bad_input_gets_openai_error(client, body, status, param, message):
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] in {"invalid_request_error", "not_found_error"}


async def test_malformed_json_is_400(client):
    response = await client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("request body is not valid JSON")


async def test_chat_rejects_non_text_parts(client):
    response = await client.post("/v1/chat/completions", json={"model": "fake", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert response.status_code == 400
    assert "only text content parts are supported" in response.json()["error"]["message"]


async def test_models_and_health(client):
    assert (await client.get("/health")).json() == {"status": "ok"}
    models = (await client.get("/v1/models")).json()
    assert [model["id"] for model in models["data"]] == ["fake"]


def test_dropped_stream_aborts_engine_request(server, loopback_server):
    server.engine.token_interval_s = 0.01
    app = OpenAIIngress({"fake": LocalModelClient(server)}).build_app()
    with loopback_server(app) as loopback:
        with httpx.stream("POST", f"{loopback.url}/v1/completions", json={
                "model": "fake", "prompt": "x", "max_tokens": 60, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if "w3" in line:
                    break
        deadline = time.monotonic() + 5
        while server.engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
    # The server noticed the closed connection, cancelled the SSE generator and closed the engine stream.
    assert server.engine.running == set()
    assert len(server.engine.aborted) == 1


@pytest.mark.parametrize("prefix", ["", "/routing"])
async def test_requests_are_counted_by_route_model_and_status(server, prefix):
    from fastapi import FastAPI
    from prometheus_client.parser import text_string_to_metric_families

    ingress = OpenAIIngress({"fake": LocalModelClient(server)})
    app = ingress.build_app()
    if prefix:  # as under a Serve route prefix: the URL carries the prefix, the route template does not
        outer = FastAPI()
        outer.mount(prefix, app)
        app = outer
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        for _ in range(2):
            assert (await http.post(f"{prefix}/v1/completions", json={"model": "fake", "prompt": "x"})).status_code == 200
        assert (await http.post(f"{prefix}/v1/completions", json={"model": "nope", "prompt": "x"})).status_code == 404
        text = (await http.get(f"{prefix}/metrics")).text
    counts = {(s.labels["model"], s.labels["status"]): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "fleetserve_requests_total" and s.labels["route"] == "/v1/completions"}
    assert counts == {("fake", "200"): 2, ("unknown", "404"): 1}
