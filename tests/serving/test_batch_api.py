"""OpenAI's Batch API (/v1/files, /v1/batches) on the plain batch service and ingress, with an httpx mock as the
platform's front door that the batches' requests go through (no Ray). Served end to end: test_batch_api_served.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from fleetserve.deployments.batches.service import BatchService
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.config import AuthConfig

DAY_S = 24 * 3600


def line(custom_id: str, model: str = "tiny", url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "prompt": custom_id, "max_tokens": 2}}


def jsonl(*lines: dict | str) -> bytes:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in lines).encode()


class FrontDoorMock:
    """The platform as a batch's requests meet it: a completion of the prompt, 404 for model `missing`; a prompt
    in ``held`` waits until ``release`` is set."""

    def __init__(self, held: tuple[str, ...] = ()) -> None:
        self.held, self.release = held, asyncio.Event()
        self.sent: list[tuple[str, str | None]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.sent.append((body["prompt"], request.headers.get("authorization")))
        if body["prompt"] in self.held:
            await self.release.wait()
        if body["model"] == "missing":
            return httpx.Response(404, json={"error": {"message": "The model `missing` does not exist.",
                                                       "code": "model_not_found"}})
        return httpx.Response(200, json={"choices": [{"text": body["prompt"].upper()}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 2}})


def service(folder: Path, door: FrontDoorMock, clock=lambda: 1000.0, max_concurrency: int = 4) -> BatchService:
    return BatchService(folder, "http://platform", max_concurrency, clock=clock, transport=httpx.MockTransport(door))


async def upload(batches: BatchService, content: bytes, owner: str | None = None) -> str:
    reply = await batches.call("upload", owner, "in.jsonl", "batch", content)
    assert reply.status_code == 200, reply.body
    return reply.body["id"]


async def create(batches: BatchService, file_id: str, owner: str | None = None, key: str | None = "sk-a",
                 **body) -> dict:
    reply = await batches.call("create_batch", owner, key, {"input_file_id": file_id, "endpoint": "/v1/completions",
                                                            "completion_window": "24h", **body})
    assert reply.status_code == 200, reply.body
    return reply.body


def output_ids(batches: BatchService, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    lines = (batches.files_dir / f"{file_id}.jsonl").read_text().splitlines()
    return sorted(json.loads(text)["custom_id"] for text in lines)


async def test_a_batch_sends_each_request_with_its_submitters_key_and_splits_answers_from_errors(tmp_path):
    door = FrontDoorMock()
    batches = service(tmp_path, door)
    file_id = await upload(batches, jsonl(line("a"), line("b"), line("c", model="missing")))
    batch = await create(batches, file_id, metadata={"job": "nightly"})
    assert (batch["status"], batch["request_counts"], batch["metadata"]) == (
        "in_progress", {"total": 3, "completed": 0, "failed": 0}, {"job": "nightly"})
    assert batch["expires_at"] == 1000 + DAY_S
    await batches.wait(batch["id"])
    done = (await batches.call("get_batch", None, batch["id"])).body
    assert (done["status"], done["completed_at"], done["request_counts"]) == (
        "completed", 1000, {"total": 3, "completed": 2, "failed": 1})
    assert sorted(door.sent) == [("a", "Bearer sk-a"), ("b", "Bearer sk-a"), ("c", "Bearer sk-a")]
    assert output_ids(batches, done["output_file_id"]) == ["a", "b"]
    assert output_ids(batches, done["error_file_id"]) == ["c"]
    content = (await batches.call("file_content", None, done["output_file_id"])).body
    answers = {json.loads(text)["custom_id"]: json.loads(text)["response"] for text in content.splitlines()}
    assert answers["a"]["status_code"] == 200 and answers["a"]["body"]["choices"][0]["text"] == "A"
    card = (await batches.call("get_file", None, done["error_file_id"])).body
    assert (card["purpose"], card["filename"]) == ("batch_output", f"{batch['id']}_error.jsonl")


@pytest.mark.parametrize(("content", "purpose", "param", "says"), [
    (jsonl(line("a"), "{not json"), "batch", "file", "in.jsonl: line 2: "),
    (jsonl(line("a"), line("a")), "batch", "file", "custom_id 'a' is line 1's too"),
    (jsonl({**line("a"), "url": "/v1/files"}), "batch", "file", "url '/v1/files' is not a path a batch can run"),
    (jsonl(line("a")), "fine-tune", "purpose", "purpose 'fine-tune' is not stored here"),
])
async def test_an_upload_that_is_no_batch_file_is_refused_naming_why(tmp_path, content, purpose, param, says):
    batches = service(tmp_path, FrontDoorMock())
    reply = await batches.call("upload", None, "in.jsonl", purpose, content)
    assert (reply.status_code, reply.body["error"]["param"]) == (400, param)
    assert says in reply.body["error"]["message"]
    assert list(batches.files_dir.iterdir()) == []  # nothing kept


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"endpoint": "/v1/chat/completions"}, "endpoint", "request 1 of file"),
    ({"endpoint": "/v1/nothing"}, "endpoint", "is not one a batch can run"),
    ({"completion_window": "1h"}, "completion_window", "completion_window: Input should be '24h'"),
    ({"input_file_id": "file-none"}, "input_file_id", "No such File object: file-none"),
    ({"priority": "high"}, "priority", "priority: Extra inputs are not permitted"),
])
async def test_a_batch_that_cannot_run_is_refused_naming_the_field(tmp_path, body, param, says):
    batches = service(tmp_path, FrontDoorMock())
    file_id = await upload(batches, jsonl(line("a")))
    request = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h", **body}
    reply = await batches.call("create_batch", None, "sk-a", request)
    assert reply.status_code in (400, 404) and reply.body["error"]["param"] == param
    assert says in reply.body["error"]["message"]
    assert batches.batches == {}


async def test_a_tenant_sees_none_of_another_tenants_files_and_batches(tmp_path):
    batches = service(tmp_path, FrontDoorMock())
    file_id = await upload(batches, jsonl(line("a")), owner="app")
    batch = await create(batches, file_id, owner="app")
    await batches.wait(batch["id"])
    for op, arg in (("get_file", file_id), ("file_content", file_id), ("delete_file", file_id),
                    ("get_batch", batch["id"]), ("cancel_batch", batch["id"])):
        assert (await batches.call(op, "other", arg)).status_code == 404, op
    assert (await batches.call("list_files", "other")).body["data"] == []
    assert (await batches.call("list_batches", "other")).body["data"] == []
    refused = await batches.call("create_batch", "other", "sk-b", {
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})
    assert refused.status_code == 404
    # The owner's list: its upload and the batch's output file.
    assert len((await batches.call("list_files", "app")).body["data"]) == 2


async def test_a_cancelled_batch_sends_nothing_more_and_keeps_what_was_answered(tmp_path):
    door = FrontDoorMock(held=("b",))
    batches = service(tmp_path, door, max_concurrency=1)
    batch = await create(batches, await upload(batches, jsonl(line("a"), line("b"), line("c"))))
    while len(door.sent) < 2:  # a answered, b held
        await asyncio.sleep(0.01)
    cancelling = (await batches.call("cancel_batch", None, batch["id"])).body
    assert cancelling["status"] == "cancelling"
    await batches.wait(batch["id"])
    done = (await batches.call("get_batch", None, batch["id"])).body
    assert (done["status"], done["request_counts"]) == ("cancelled", {"total": 3, "completed": 1, "failed": 0})
    assert [prompt for prompt, _ in door.sent] == ["a", "b"]  # c never sent
    assert output_ids(batches, done["output_file_id"]) == ["a"] and done["error_file_id"] is None
    again = await batches.call("cancel_batch", None, batch["id"])
    assert (again.status_code, again.body["error"]["code"]) == (409, "batch_not_running")


async def test_a_batch_still_running_when_its_window_ends_expires(tmp_path):
    now = [1000.0]
    door = FrontDoorMock(held=("a", "b"))
    batches = service(tmp_path, door, clock=lambda: now[0], max_concurrency=1)
    batch = await create(batches, await upload(batches, jsonl(line("a"), line("b"))))
    now[0] += DAY_S  # before its run starts, which finds its 24 h window over
    await batches.wait(batch["id"])
    done = (await batches.call("get_batch", None, batch["id"])).body
    assert (done["status"], done["expired_at"], done["request_counts"]) == (
        "expired", 1000 + DAY_S, {"total": 2, "completed": 0, "failed": 0})
    assert done["output_file_id"] is None and done["error_file_id"] is None


async def test_a_restarted_service_ends_the_batches_it_left_running_with_their_results(tmp_path):
    door = FrontDoorMock(held=("b",))
    first = service(tmp_path, door, max_concurrency=1)
    batch = await create(first, await upload(first, jsonl(line("a"), line("b"))))
    while len(door.sent) < 2:
        await asyncio.sleep(0.01)
    first._runs[batch["id"]].cancel()  # the replica died mid-batch
    second = service(tmp_path, FrontDoorMock())
    done = (await second.call("get_batch", None, batch["id"])).body
    assert (done["status"], done["request_counts"]["completed"]) == ("failed", 1)
    assert done["errors"]["data"][0]["code"] == "batch_service_restarted"
    assert output_ids(second, done["output_file_id"]) == ["a"]
    # Its files outlived the restart.
    assert (await second.call("get_file", None, batch["input_file_id"])).status_code == 200


async def test_batches_list_newest_first_a_page_at_a_time(tmp_path):
    now = [1000.0]
    batches = service(tmp_path, FrontDoorMock(), clock=lambda: now[0])
    file_id = await upload(batches, jsonl(line("a")))
    ids = []
    for _ in range(3):
        ids.append((await create(batches, file_id))["id"])
        now[0] += 1
    first = (await batches.call("list_batches", None, None, 2)).body
    assert ([b["id"] for b in first["data"]], first["has_more"]) == ([ids[2], ids[1]], True)
    rest = (await batches.call("list_batches", None, first["last_id"], 2)).body
    assert ([b["id"] for b in rest["data"]], rest["has_more"]) == ([ids[0]], False)
    for batch_id in ids:
        await batches.wait(batch_id)


# --- through the ingress ---------------------------------------------------------------------------------------


def ingress(batches: BatchService | None, front_door: FrontDoor | None = None, max_file_bytes: int = 10_000):
    return OpenAIIngress({}, batches=batches, front_door=front_door, max_file_bytes=max_file_bytes).build_app()


async def test_the_openai_batch_flow_through_the_ingress_with_keys(tmp_path):
    keys = {"app": "sk-app-0001", "other": "sk-oth-0002"}
    door = FrontDoor(AuthConfig.model_validate({
        "tenants": {"app": {}, "other": {}},
        "api_keys": [{"sha256": hash_key(key), "tenant": tenant} for tenant, key in keys.items()]}))
    platform = FrontDoorMock()
    app = ingress(service(tmp_path, platform), door)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        auth = {"authorization": f"Bearer {keys['app']}"}
        uploaded = await http.post("/v1/files", headers=auth, data={"purpose": "batch"},
                                   files={"file": ("mine.jsonl", jsonl(line("a"), line("b")))})
        assert uploaded.status_code == 200, uploaded.text
        assert (uploaded.json()["filename"], uploaded.json()["bytes"]) == ("mine.jsonl",
                                                                           len(jsonl(line("a"), line("b"))))
        created = await http.post("/v1/batches", headers=auth, json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        while (batch := (await http.get(f"/v1/batches/{batch_id}", headers=auth)).json())["status"] != "completed":
            await asyncio.sleep(0.01)
        content = await http.get(f"/v1/files/{batch['output_file_id']}/content", headers=auth)
        assert sorted(json.loads(text)["custom_id"] for text in content.text.splitlines()) == ["a", "b"]
        # The requests went to the platform with the submitter's own key.
        assert {key for _, key in platform.sent} == {f"Bearer {keys['app']}"}
        other = {"authorization": f"Bearer {keys['other']}"}
        assert (await http.get(f"/v1/batches/{batch_id}", headers=other)).status_code == 404
        assert (await http.get("/v1/batches")).status_code == 401
        too_big = await http.post("/v1/files", headers=auth, data={"purpose": "batch"},
                                  files={"file": ("big.jsonl", b"x" * 20_000)})
        assert (too_big.status_code, too_big.json()["error"]["code"]) == (400, "request_too_large")
        missing = await http.post("/v1/files", headers=auth, data={"purpose": "batch"})
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "file")
        bad_limit = await http.get("/v1/batches?limit=many", headers=auth)
        assert (bad_limit.status_code, bad_limit.json()["error"]["param"]) == (400, "limit")


async def test_without_batches_configured_the_paths_say_how_to_turn_them_on():
    app = ingress(None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        for method, path in (("GET", "/v1/batches"), ("POST", "/v1/batches"), ("POST", "/v1/files"),
                             ("GET", "/v1/files/file-1/content")):
            answer = await http.request(method, path)
            assert (answer.status_code, answer.json()["error"]["code"]) == (404, "batches_off"), path
            assert "add `batches: {}` to its config" in answer.json()["error"]["message"]
