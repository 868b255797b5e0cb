"""ReplicaAdapters: a source that cannot load is refused as vLLM's admin endpoint would, before vLLM sees it."""

from __future__ import annotations

import asyncio
import json
import pickle
from types import SimpleNamespace

import pytest

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
    code, body = asyncio.run(ReplicaAdapters(tmp_path).change(app, AdapterOp.LOAD, "x", source))
    error = json.loads(body)["error"]
    assert (code, error["type"], error["code"], error["param"]) == (status, kind, status, "lora_path")
    assert message in error["message"]


def test_an_adapter_source_error_keeps_its_status_across_pickling():
    error = pickle.loads(pickle.dumps(AdapterSourceError("bad seed", 400)))
    assert (str(error), error.status_code) == ("bad seed", 400)
