"""ReplicaAdapters: a source that cannot load is refused as vLLM's admin endpoint would, before vLLM sees it."""

from __future__ import annotations

import asyncio
import json
import pickle
from types import SimpleNamespace

import pytest

from factories import peft_folder
from fleetserve.platform.adapter_registry import AdapterOp
from fleetserve.platform.lora_store import AdapterSourceError
from fleetserve.platform.replica_adapters import ReplicaAdapters

pytest.importorskip("vllm")


@pytest.mark.parametrize(("source", "status", "kind", "message"), [
    ("random-lora:abc", 400, "BadRequestError", "expected random-lora:<seed>, a non-negative integer seed"),
    ("/no/such/adapter", 404, "NotFoundError", "'/no/such/adapter' not found"),
])
def test_an_unloadable_source_is_refused_with_its_status(tmp_path, source, status, kind, message):
    # No serving-models object: the refusal comes before vLLM is asked.
    app = SimpleNamespace(state=SimpleNamespace(openai_serving_models=None))
    code, body = asyncio.run(ReplicaAdapters(tmp_path, 8).change(app, AdapterOp.LOAD, "x", source))
    error = json.loads(body)["error"]
    assert (code, error["type"], error["code"], error["param"]) == (status, kind, status, "lora_path")
    assert message in error["message"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"r": 16}, "LoRA rank 16 is greater than max_lora_rank 8."),
    ({"rank_pattern": {"q_proj": 32}}, "LoRA rank 32 is greater than max_lora_rank 8."),
    ({"use_dora": True}, "vLLM does not yet support DoRA."),
    ({"weights": False}, "holds no weights: expected one of adapter_model.safetensors"),
])
def test_an_adapter_vllm_would_refuse_is_a_400_with_its_reason(tmp_path, fields, message):
    folder = peft_folder(tmp_path / "adapter", **fields)
    app = SimpleNamespace(state=SimpleNamespace(openai_serving_models=None))
    # vLLM itself answers these with a 500 once an engine has tried the adapter.
    code, body = asyncio.run(ReplicaAdapters(tmp_path, 8).change(app, AdapterOp.LOAD, "x", str(folder)))
    error = json.loads(body)["error"]
    assert (code, error["type"], error["param"]) == (400, "BadRequestError", "lora_path")
    assert error["message"].startswith(f"adapter folder {folder}") and message in error["message"]


@pytest.mark.parametrize(("config", "message"), [
    ("{not json", "Expecting property name"),
    ('{"r": 8}', "Missing required configuration fields"),
])
def test_a_malformed_adapter_config_is_a_400(tmp_path, config, message):
    folder = peft_folder(tmp_path / "adapter")
    (folder / "adapter_config.json").write_text(config)
    app = SimpleNamespace(state=SimpleNamespace(openai_serving_models=None))
    code, body = asyncio.run(ReplicaAdapters(tmp_path, 8).change(app, AdapterOp.LOAD, "x", str(folder)))
    assert code == 400 and message in json.loads(body)["error"]["message"]


class FakeServingModels:
    """vLLM's serving-models object as ReplicaAdapters uses it: the adapters served, and a slow load."""

    def __init__(self) -> None:
        self.lora_requests: dict[str, object] = {}
        self.base_model_paths = [SimpleNamespace(name="base")]
        self.loads: list[str] = []

    async def load_lora_adapter(self, request, base_model_name):
        await asyncio.sleep(0.02)  # a replica reading the adapter's files
        self.loads.append(request.lora_name)
        self.lora_requests[request.lora_name] = request
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request):
        self.lora_requests.pop(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."


def test_a_root_adapter_loads_once_for_the_requests_that_name_it_and_the_registry_keeps_it(tmp_path):
    from fleetserve.platform.adapter_registry import AdapterSet

    folder = str(peft_folder(tmp_path / "sql"))
    models = FakeServingModels()
    app = SimpleNamespace(state=SimpleNamespace(openai_serving_models=models))
    adapters = ReplicaAdapters(tmp_path, 8)

    async def scenario():
        first = await asyncio.gather(*(adapters.ensure(app, "base:sql", folder) for _ in range(3)))
        later = await adapters.ensure(app, "base:sql", folder)
        # The registry's set (one configured adapter) neither names it nor unloads it.
        await adapters.sync(app, AdapterSet(version=1, sources={"conf": folder}))
        return first, later

    first, later = asyncio.run(scenario())
    assert [status for status, _ in first] == [200, 200, 200] and later == (200, b"")
    assert models.loads == ["base:sql", "conf"]  # three requests at once, one load; then the registry's
    assert sorted(models.lora_requests) == ["base:sql", "conf"] and adapters.version == 1


def test_a_root_adapter_missing_its_folder_is_an_error_naming_the_model(tmp_path):
    from fleetserve.platform.adapter_root import load_error

    app = SimpleNamespace(state=SimpleNamespace(openai_serving_models=FakeServingModels()))
    status, body = asyncio.run(ReplicaAdapters(tmp_path, 8).ensure(app, "base:nope", str(tmp_path / "nope")))
    error = json.loads(load_error("base:nope", status, body))["error"]
    assert (status, error["type"], error["param"], error["code"]) == (404, "not_found_error", "model",
                                                                      "model_not_found")
    assert error["message"].startswith(f"The model `base:nope` does not exist: adapter source '{tmp_path / 'nope'}'")
