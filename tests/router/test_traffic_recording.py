"""Recorded routed traffic and feedback: opt-in per tenant, the records exactly, rotation, and the strong share."""

from __future__ import annotations

import json

import httpx
import pytest
from factories import EASY_PROMPT, HARD_PROMPT, calibrated_classifier

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.config import AuthConfig, ModelConfig, ModelRoutingConfig
from fleetserve.router.model.routes import RouteTable
from fleetserve.router.model.traffic import FeedbackRecord, RouteRecord, TrafficRecorder, read_records, tenant_hash

KEYS = {"alpha": "sk-alpha-0001", "beta": "sk-beta-0002"}
HARD, EASY = HARD_PROMPT, EASY_PROMPT


@pytest.fixture(scope="module")
def classifier():
    return calibrated_classifier(0.25)


def ingress(fake_engine_cls, classifier, recording, auth=True) -> OpenAIIngress:
    servers = {name: EngineServer(ModelConfig(name=name, source="unused"), engine_cls=fake_engine_cls,
                                  model_path="/unused") for name in ("cheap", "pricey")}
    models = {"cheap": ModelConfig(name="cheap", source="x", cost_per_million_output_tokens=1.0),
              "pricey": ModelConfig(name="pricey", source="x", cost_per_million_output_tokens=10.0)}
    config = ModelRoutingConfig.model_validate({
        "tiers": ["cheap", "pricey"], "recording": recording,
        "routes": [{"name": "auto", "router": "classifier", "strong_fraction": 0.25}]})
    front_door = FrontDoor(AuthConfig.model_validate({
        "tenants": {"alpha": {"record_routed_prompts": True}, "beta": {}},
        "api_keys": [{"sha256": hash_key(key), "tenant": name} for name, key in KEYS.items()]})) if auth else None
    return OpenAIIngress({name: LocalModelClient(server) for name, server in servers.items()}, models=models,
                         routes=RouteTable(config, routers={"classifier": classifier}), front_door=front_door)


def http(app_ingress: OpenAIIngress) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app_ingress.build_app()), base_url="http://test")


async def chat(client, tenant, text):
    return await client.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEYS[tenant]}"}, json={
        "model": "auto", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
        "max_tokens": 2})


async def test_only_opted_in_tenants_are_recorded_with_exact_fields(fake_engine_cls, classifier, tmp_path):
    path = tmp_path / "traffic"
    async with http(ingress(fake_engine_cls, classifier, {"directory": str(path)})) as client:
        hard = await chat(client, "alpha", HARD)
        easy = await chat(client, "alpha", EASY)
        await chat(client, "beta", HARD)  # beta did not opt in
        liked = await client.post("/v1/feedback", headers={"authorization": f"Bearer {KEYS['alpha']}"},
                                  json={"request_id": hard.headers["x-request-id"], "thumbs": "up"})
        scored = await client.post("/v1/feedback", headers={"authorization": f"Bearer {KEYS['alpha']}"},
                                   json={"request_id": easy.headers["x-request-id"], "score": 0.25})
        metrics = (await client.get("/metrics", headers={"authorization": f"Bearer {KEYS['alpha']}"}))
    assert liked.status_code == 200 and liked.json() == {"object": "feedback", "request_id": hard.headers["x-request-id"],
                                                         "score": 1.0}
    assert scored.status_code == 200 and scored.json()["score"] == 0.25
    records = list(read_records(path))
    assert [type(r) for r in records] == [RouteRecord, RouteRecord, FeedbackRecord, FeedbackRecord]
    first, second = records[0], records[1]
    assert (first.request_id, first.tenant, first.route, first.prompt) == (
        hard.headers["x-request-id"], tenant_hash("alpha"), "auto", HARD)  # the last user message, as routed
    assert (first.model, first.tier_index, first.strongest, first.reason) == ("pricey", 1, True, "strongest_needed")
    assert first.win_rate == pytest.approx(float(hard.headers["x-fleetserve-win-rate"]), abs=1e-6)
    assert (second.model, second.strongest, second.reason) == ("cheap", False, "below_threshold")
    assert [(r.request_id, r.score) for r in records[2:]] == [(hard.headers["x-request-id"], 1.0),
                                                              (easy.headers["x-request-id"], 0.25)]
    (live,) = path.iterdir()  # one file per ingress process
    assert live.name.startswith("routed-") and live.suffix == ".jsonl"
    assert "alpha" not in live.read_text()  # tenants appear only as hashes
    assert metrics.status_code == 403  # alpha is no admin; the share is checked below


async def test_strong_share_and_its_target_are_metrics(fake_engine_cls, classifier, tmp_path):
    app_ingress = ingress(fake_engine_cls, classifier, None, auth=False)
    async with http(app_ingress) as client:
        for text in (HARD, EASY, EASY, EASY):
            response = await client.post("/v1/chat/completions", json={
                "model": "auto", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
            assert response.status_code == 200
        text = (await client.get("/metrics")).text
        # 1 of 4 requests went to the strongest tier; the route's target is its strong_fraction 0.25.
        assert 'fleetserve_route_strong_share{route="auto"} 0.25' in text
        assert 'fleetserve_route_strong_share_target{route="auto"} 0.25' in text
        # With no recording configured, feedback is refused, naming what to set.
        refused = await client.post("/v1/feedback", json={"request_id": "req-1", "thumbs": "up"})
        assert refused.status_code == 403
        assert "model_routing.recording.anonymous" in refused.json()["error"]["message"]


async def test_anonymous_recording_and_bad_feedback_bodies(fake_engine_cls, classifier, tmp_path):
    path = tmp_path / "traffic"
    async with http(ingress(fake_engine_cls, classifier, {"directory": str(path), "anonymous": True},
                            auth=False)) as client:
        await client.post("/v1/completions", json={"model": "auto", "prompt": EASY, "max_tokens": 2})
        for body, param in (({"request_id": "r"}, None), ({"request_id": "r", "score": 1.5}, "score"),
                            ({"request_id": "r", "thumbs": "sideways"}, "thumbs"),
                            ({"request_id": "r", "score": 1, "rating": 5}, "rating")):
            response = await client.post("/v1/feedback", json=body)
            assert response.status_code == 400, body
            assert response.json()["error"]["param"] == param
    (record,) = read_records(path)
    assert (record.tenant, record.prompt, record.model) == (tenant_hash("anonymous"), EASY, "cheap")


async def test_feedback_without_routing_is_404(fake_engine_cls):
    server = EngineServer(ModelConfig(name="m", source="unused"), engine_cls=fake_engine_cls, model_path="/unused")
    async with http(OpenAIIngress({"m": LocalModelClient(server)})) as client:
        response = await client.post("/v1/feedback", json={"request_id": "r", "thumbs": "up"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_records_rotate_by_size_and_read_back_oldest_first(tmp_path):
    recorder = TrafficRecorder(tmp_path, max_bytes=1024, num_backups=2, name="t.jsonl")
    for i in range(30):
        recorder.record_feedback(f"req-{i:02d}", "alpha", 0.5)
    recorder.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    ids = [r.request_id for r in read_records(tmp_path / "t.jsonl")]
    # Oldest rotated away; what is kept is the newest, in order, ending at the last write.
    assert ids == sorted(ids) and ids[-1] == "req-29" and len(ids) < 30
    line = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[-1])
    assert line["type"] == "feedback" and line["tenant"] == tenant_hash("alpha")


def test_a_folder_reads_every_process_file(tmp_path):
    for name in ("routed-a-1.jsonl", "routed-b-2.jsonl"):
        recorder = TrafficRecorder(tmp_path, max_bytes=1 << 20, num_backups=1, name=name)
        recorder.record_feedback(name, "alpha", 1.0)
        recorder.close()
    assert [r.request_id for r in read_records(tmp_path)] == ["routed-a-1.jsonl", "routed-b-2.jsonl"]


def test_a_foreign_line_names_its_file_and_line(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"type": "feedback", "request_id": "r", "tenant": "x", "score": 1, "time": 0}\n'
                                      '{"hello": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a fleetserve traffic record"):
        list(read_records(tmp_path / "t.jsonl"))
