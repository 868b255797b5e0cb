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
