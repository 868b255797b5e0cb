"""Request limits, admission control and progress timeouts at the ingress, on a fake engine (no Ray)."""

from __future__ import annotations

import asyncio
import json
import pickle

import httpx
import pytest

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.deployments.ingress.streaming import as_api_error
from fleetserve.platform.config import LimitsConfig, ModelConfig
from fleetserve.platform.engine import EngineRequestError


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


async def non_streamed(engine_cls, monkeypatch, token_interval_s: float, max_tokens: int):
    """A non-streamed completion under a 0.5 s progress timeout, its replica heartbeating each 0.1 s."""
    class Paced(engine_cls):
        pass

    Paced.token_interval_s = token_interval_s
    monkeypatch.setattr("fleetserve.platform.relay.HEARTBEAT_S", 0.1)
    app, server = ingress(Paced, progress_timeout_s=0.5)
    async with http(app) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": max_tokens})
    return response, app, server


async def test_a_long_answer_that_progresses_is_not_taken_for_a_stuck_one(fake_engine_cls, monkeypatch):
    response, _, server = await non_streamed(fake_engine_cls, monkeypatch, token_interval_s=0.2, max_tokens=10)
    # 10 tokens 0.2 s apart: 1.8 s in all, far past the 0.5 s progress timeout, with no body until the end.
    # The replica's heartbeats (one per 0.1 s in which a token came) say it progresses.
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 10 and server.engine.aborted == []


async def test_a_stuck_answer_is_aborted_though_its_replica_sends_heartbeats(fake_engine_cls, monkeypatch):
    response, app, server = await non_streamed(fake_engine_cls, monkeypatch, token_interval_s=5.0, max_tokens=3)
    # One heartbeat for the first token; then nothing for 5 s, so no more, and the timeout runs out.
    assert response.status_code == 504 and response.json()["error"]["code"] == "no_progress"
    assert server.engine.aborted != [] and server.engine.running == set() and app.in_flight == {"fake": 0}


class FlakyClient:
    """Reaches a fake engine server, but the first ``num_failures`` calls fail the way a dead replica does,
    ``after_chunks`` chunks into the stream: with ActorDiedError, or (``cut_off``) by ending the stream without
    an error, as Ray can for an actor on a lost node."""

    def __init__(self, server: EngineServer, num_failures: int, after_chunks: int = 0, cut_off: bool = False) -> None:
        self.server = server
        self.num_failures = num_failures
        self.after_chunks = after_chunks
        self.cut_off = cut_off
        self.num_calls = 0

    async def forward(self, request):
        from ray.exceptions import ActorDiedError

        self.num_calls += 1
        failing = self.num_calls <= self.num_failures
        index = 0
        async for chunk in self.server.forward(request):
            if failing and index == self.after_chunks:
                if self.cut_off:
                    return
                raise ActorDiedError()
            index += 1
            yield chunk

    def route_reason(self, request_id):
        return None


def flaky_ingress(fake_engine_cls, num_failures: int, after_chunks: int = 0, cut_off: bool = False, **limits):
    server = EngineServer(ModelConfig(name="fake", source="unused"), engine_cls=fake_engine_cls, model_path="/unused")
    client = FlakyClient(server, num_failures, after_chunks, cut_off)
    return OpenAIIngress({"fake": client}, limits=LimitsConfig(**limits)), client


async def test_replica_dying_before_any_output_is_retried(fake_engine_cls):
    app, client = flaky_ingress(fake_engine_cls, num_failures=2, max_unstarted_retries=2)
    async with http(app) as http_client:
        response = await http_client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3})
    # Two dead replicas, then a live one: 3 calls, and the caller sees only the success.
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "w0 w1 w2"
    assert client.num_calls == 3
    assert 'fleetserve_engine_retries_total{model="fake"} 2.0' in app.platform_metrics.exposition().decode()


async def test_retries_spent_is_a_clear_503(fake_engine_cls):
    app, client = flaky_ingress(fake_engine_cls, num_failures=5, max_unstarted_retries=1)
    async with http(app) as http_client:
        response = await http_client.post("/v1/completions", json={"model": "fake", "prompt": "a"})
    assert (response.status_code, response.json()["error"]["code"]) == (503, "engine_unavailable")
    assert client.num_calls == 2 and app.in_flight == {"fake": 0}


@pytest.mark.parametrize("cut_off", [False, True], ids=["dies", "cut-off"])
async def test_replica_failing_mid_stream_ends_it_with_an_error_event(fake_engine_cls, cut_off):
    app, client = flaky_ingress(fake_engine_cls, num_failures=1, after_chunks=2, cut_off=cut_off)
    # Tokens far enough apart that each replica chunk holds one event (ready events are coalesced).
    client.server.engine.token_interval_s = 0.05
    async with http(app) as http_client:
        response = await http_client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 5,
                                                                    "stream": True})
    # Two chunks reached the client; output cannot be unsent, so the stream ends with an error event (also when
    # it just ended with no final chunk: never a silent truncation), and is not retried.
    assert response.status_code == 200 and client.num_calls == 1
    assert response.text.count('"text"') == 2 and '"code":"engine_unavailable"' in response.text
    assert response.text.endswith("data: [DONE]\n\n") and app.in_flight == {"fake": 0}


async def test_a_response_cut_off_is_a_503_not_a_partial_body(fake_engine_cls):
    app, client = flaky_ingress(fake_engine_cls, num_failures=1, after_chunks=1, cut_off=True)
    client.server.engine.token_interval_s = 0.05
    async with http(app) as http_client:
        response = await http_client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 5})
    assert (response.status_code, response.json()["error"]["code"]) == (503, "engine_unavailable")


async def test_a_stream_cut_off_before_any_output_is_retried(fake_engine_cls):
    app, client = flaky_ingress(fake_engine_cls, num_failures=1, after_chunks=0, cut_off=True)
    async with http(app) as http_client:
        response = await http_client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3})
    # The first call ended with nothing at all; the second, on a live replica, answered.
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "w0 w1 w2"
    assert client.num_calls == 2
    assert 'fleetserve_engine_retries_total{model="fake"} 1.0' in app.platform_metrics.exposition().decode()


class TwoReplicas:
    """Two in-process replicas, chosen as fleetserve's Serve router chooses: the first one the request does not
    avoid (``RoutingHints.avoid_replica_ids``), else the first."""

    def __init__(self, engine_cls) -> None:
        self.servers = [EngineServer(ModelConfig(name="fake", source="unused"), engine_cls=engine_cls,
                                     replica_id=f"r{index}", model_path="/unused") for index in range(2)]
        # The replica each call went to, in order.
        self.called_ids: list[str] = []

    def forward(self, request):
        server = next((server for server in self.servers
                       if server.replica_id not in request.routing.avoid_replica_ids), self.servers[0])
        self.called_ids.append(server.replica_id)
        return server.forward(request)

    def route_reason(self, request_id):
        return None


async def test_a_dead_engine_fails_the_request_over_to_another_replica(fake_engine_cls):
    replicas = TwoReplicas(fake_engine_cls)
    replicas.servers[0].engine.errored = True
    app = OpenAIIngress({"fake": replicas}, limits=LimitsConfig(max_unstarted_retries=2))
    async with http(app) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3})
    # r0 refused it before any output, so the retry went to r1, which answered; r0's engine never saw it.
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "w0 w1 w2"
    assert replicas.called_ids == ["r0", "r1"] and replicas.servers[0].engine.bodies == []
    assert 'fleetserve_engine_retries_total{model="fake"} 1.0' in app.platform_metrics.exposition().decode()


@pytest.mark.parametrize(("by_raising", "message"), [
    # vLLM's chat and completions streams end with an InternalServerError event, "See stack trace (above)".
    (False, "the model's engine died during the response (replica r0); retry the request"),
    # vLLM's Responses stream raises mid-body: before, the stream ended as a whole one would, with no error.
    (True, "the model's engine is unavailable (replica r0's engine has died; Serve is replacing the replica); "
           "retry after 10 s"),
], ids=["error-event", "raising"])
async def test_an_engine_dying_mid_stream_ends_it_with_engine_unavailable(fake_engine_cls, by_raising, message):
    class DiesAfterTwo(fake_engine_cls):
        die_after_tokens = 2
        die_by_raising = by_raising
        token_interval_s = 0.05  # one event per replica chunk

    replicas = TwoReplicas(DiesAfterTwo)
    app = OpenAIIngress({"fake": replicas})
    async with http(app) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 5,
                                                               "stream": True})
    events = [event.removeprefix("data: ") for event in response.text.split("\n\n") if event]
    # Two tokens reached the client, so the stream cannot be sent again; it ends as a replica's death mid-stream
    # does.
    assert [json.loads(event)["choices"][0]["text"] for event in events[:2]] == ["w0", " w1"]
    assert json.loads(events[2]) == {"error": {
        "message": message, "type": "service_unavailable", "param": None, "code": "engine_unavailable"}}
    assert events[3:] == ["[DONE]"] and replicas.called_ids == ["r0"] and app.in_flight == {"fake": 0}


async def test_a_stream_whose_engine_dies_before_its_first_token_is_sent_again(fake_engine_cls):
    replicas = TwoReplicas(fake_engine_cls)
    replicas.servers[0].engine.die_after_tokens = 0
    app = OpenAIIngress({"fake": replicas}, limits=LimitsConfig(max_unstarted_retries=2))
    async with http(app) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3,
                                                               "stream": True})
    # r0's stream began with vLLM's error event, before any token: r1 served it, and the client saw only that.
    # Before, the stream was relayed with the error (HTTP 200) though nothing had been generated.
    events = [event.removeprefix("data: ") for event in response.text.split("\n\n") if event]
    assert [json.loads(event)["choices"][0]["text"] for event in events[:-1]] == ["w0", " w1", " w2"]
    assert events[-1] == "[DONE]" and replicas.called_ids == ["r0", "r1"] and app.in_flight == {"fake": 0}


async def test_a_dead_engine_with_no_other_replica_is_a_503_naming_it(fake_engine_cls):
    replicas = TwoReplicas(fake_engine_cls)
    for server in replicas.servers:
        server.engine.errored = True
    app = OpenAIIngress({"fake": replicas}, limits=LimitsConfig(max_unstarted_retries=2))
    async with http(app) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "stream": True})
    error = response.json()["error"]
    # r0, then r1 (avoiding r0), then with both avoided the first again: 3 calls, then the retries are spent.
    assert replicas.called_ids == ["r0", "r1", "r0"]
    assert (response.status_code, error["code"]) == (503, "engine_unavailable")
    assert error["message"] == ("the model's engine is unavailable (replica r0's engine has died; Serve is replacing "
                                "the replica); retry after 10 s")
    # Serve's health check (every 10 s) notices the dead engine and starts a successor: the client's wait.
    assert response.headers["retry-after"] == "10"
    assert app.in_flight == {"fake": 0}


def test_vllms_engine_error_handler_stops_the_replicas_stand_in_server():
    from types import SimpleNamespace

    from vllm.entrypoints.serve.exception_handling.handlers.vllm_error import engine_error_handler
    from vllm.v1.engine.exceptions import EngineDeadError

    from fleetserve.platform.openai_app import ServerStandIn

    # The state build_openai_app leaves; without a `server` there, vLLM's handler itself raised
    # AttributeError, and every request to a replica whose engine died got "'State' object has no attribute".
    state = SimpleNamespace(args=SimpleNamespace(log_error_stack=False), server=ServerStandIn(),
                            engine_client=SimpleNamespace(errored=True, is_running=False))
    response = asyncio.run(engine_error_handler(SimpleNamespace(app=SimpleNamespace(state=state),
                                                                state=SimpleNamespace()), EngineDeadError()))
    assert response.status_code == 500 and state.server.should_exit


@pytest.mark.parametrize("failure", ["send_fails", "client_disconnects"])
async def test_event_stream_closes_its_iterator_when_the_client_goes(failure):
    from starlette.responses import StreamingResponse

    from fleetserve.deployments.ingress.streaming import EventStreamResponse

    # (response, events yielded) when each body iterator ended.
    closed: list[tuple[str, int]] = []

    async def events(name: str):
        num_yielded = 0
        try:
            for index in range(1000):
                yield f"data: {index}\n\n"
                num_yielded += 1
                await asyncio.sleep(0.001)
        finally:
            closed.append((name, num_yielded))

    async def send(message) -> None:
        # The first body chunk fails, as sending to a closed connection does under an ASGI 2.4 server.
        if failure == "send_fails" and message["type"] == "http.response.body":
            raise OSError("connection closed")

    async def receive():
        if failure == "client_disconnects":
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    for name, response_cls in [("fleetserve", EventStreamResponse), ("starlette", StreamingResponse)]:
        try:
            await asyncio.wait_for(response_cls(events(name))(scope, receive, send), timeout=5)
        except Exception:  # noqa: BLE001 - Starlette raises ClientDisconnect; only the iterator matters here
            pass
    # Ours ends its iterator (so the engine request) at once: at the failed first send, or at the
    # disconnect (~50 of 1000 events in). Starlette's plain streaming response leaves the iterator
    # suspended when a send fails, and streams all 1000 events to a client that has gone.
    if failure == "send_fails":
        assert closed == [("fleetserve", 0)]
    else:
        assert closed[0][0] == "fleetserve" and closed[0][1] < 1000 and closed[1] == ("starlette", 1000)


def test_an_engine_refusal_keeps_its_code_and_retry_after_across_ray():
    # As a decode replica refuses when its prefill pool has none running; Ray pickles it to the ingress.
    refusal = EngineRequestError("the prefill pool has no running replica; retry after 10 s", 503,
                                 error_type="service_unavailable", code="prefill_unavailable", retry_after_s=10)
    error = as_api_error(pickle.loads(pickle.dumps(refusal)))
    assert (error.status_code, error.headers) == (503, {"Retry-After": "10"})
    assert error.body() == {"error": {"message": "the prefill pool has no running replica; retry after 10 s",
                                      "type": "service_unavailable", "param": None, "code": "prefill_unavailable"}}
    assert as_api_error(EngineRequestError("bad", param="n")).headers is None


def anthropic_client(app):
    import anthropic
    import httpx2  # the Anthropic SDK's own fork of httpx

    transport = httpx2.ASGITransport(app=app.build_app())
    return anthropic.AsyncAnthropic(api_key="unused", base_url="http://test", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport, base_url="http://test"))


async def anthropic_stream(app) -> tuple[list[str], Exception | None]:
    """The text an Anthropic SDK client streamed from /v1/messages, and the error its stream raised."""
    texts: list[str] = []
    try:
        async with anthropic_client(app) as client:
            async with client.messages.stream(model="fake", max_tokens=5,
                                              messages=[{"role": "user", "content": "a"}]) as stream:
                async for text in stream.text_stream:
                    texts.append(text)
    except Exception as error:  # noqa: BLE001
        return texts, error
    return texts, None


async def test_an_anthropic_stream_whose_engine_dies_raises_engine_unavailable_in_anthropics_sdk(fake_engine_cls):
    class DiesAfterTwo(fake_engine_cls):
        die_after_tokens = 2
        token_interval_s = 0.05

    replicas = TwoReplicas(DiesAfterTwo)
    texts, error = await anthropic_stream(OpenAIIngress({"fake": replicas}))
    # vLLM's own event said "2 validation errors for ChatCompletionStreamResponse".
    assert texts == ["w0", " w1"] and replicas.called_ids == ["r0"]
    assert error.body == {"type": "error", "error": {
        "type": "service_unavailable",
        "message": "the model's engine died during the response (replica r0); retry the request"}}


async def test_an_anthropic_stream_whose_replica_dies_raises_in_anthropics_sdk(fake_engine_cls):
    app, client = flaky_ingress(fake_engine_cls, num_failures=1, after_chunks=2)
    # Apart enough that message_start and content_block_start make the first replica chunk, w0 the second.
    client.server.engine.first_token_s = client.server.engine.token_interval_s = 0.05
    texts, error = await anthropic_stream(app)
    # Before, the ingress ended it with OpenAI's error data, which Anthropic's SDKs skip (no `event:` line): the
    # client saw a stream that just stopped, no error.
    assert texts == ["w0"] and client.num_calls == 1 and app.in_flight == {"fake": 0}
    assert error.body == {"type": "error", "error": {
        "type": "service_unavailable",
        "message": "the model's engine is unavailable (ActorDiedError); retry after 10 s"}}


async def test_errors_on_anthropics_paths_take_anthropics_shape_as_vllms_do(fake_engine_cls):
    app, _ = ingress(fake_engine_cls, max_tokens=8)
    chat = {"role": "user", "content": "a"}
    async with http(app) as client:
        unknown = await client.post("/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": [chat]})
        too_many = await client.post("/v1/messages", json={"model": "fake", "max_tokens": 9, "messages": [chat]})
        unread = await client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": [chat], "x": 1})
        openai = await client.post("/v1/chat/completions", json={"model": "nope", "messages": [chat]})
    # The ingress's own refusals (before: OpenAI's {"error": {...}} where vLLM answers {"type": "error", ...}).
    assert (unknown.status_code, unknown.json()) == (404, {"type": "error", "error": {
        "type": "not_found_error", "message": "The model `nope` does not exist. Available models: fake"}})
    assert (too_many.status_code, too_many.json()["type"], too_many.json()["error"]["type"]) == (
        400, "error", "invalid_request_error")
    # A replica's refusal, relayed.
    assert (unread.status_code, unread.json()["type"]) == (400, "error")
    assert unread.json()["error"]["message"].startswith("Unsupported parameter(s): x.")
    assert openai.json()["error"]["code"] == "model_not_found"  # OpenAI's paths keep OpenAI's shape
