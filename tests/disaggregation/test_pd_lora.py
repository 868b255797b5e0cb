"""LoRA adapters on disaggregated serving, on real vLLM engines with NixlConnector, without Ray: a prefill and a
decode server, and a colocated reference engine with the same engine args and adapters.

SmolLM2 in float32, whose greedy output follows the prompt's KV: a prefill run without the adapter would hand
the decode engine KV that gives other tokens than the reference's. The prefill engine publishes its KV events, as
a prefill pool routed on them does.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest

from factories import MiB, model_entry
from fleetserve.deployments.disaggregated.decode_server import DecodeServer, LocalPrefillClient
from fleetserve.deployments.disaggregated.prefill_server import PrefillServer
from fleetserve.deployments.engine_server import EngineServer
from fleetserve.platform.api_types import ApiRequest, Endpoint
from fleetserve.loadtest.local_server import free_port
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import KV_EVENTS_TOPIC
from fleetserve.platform.kv_transfer import KVTransferSpec, lease_side_channel_ports
from fleetserve.platform.lora_store import random_lora
from fleetserve.platform.model_store import resolve_source
from fleetserve.router.replica.kv_events import AdapterTokens, KVEventIndex, KVEventSubscriber

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
pytest.importorskip("nixl", reason="disaggregation needs nixl (make install adds it)")

BASE = "smollm2"
# A configured adapter, and one from the adapter root (its folder `b`).
CONFIGURED, ROOTED = "smol-a", f"{BASE}:b"
# Two blocks of 128 tokens and a part: the decode engine pulls whole blocks and computes the rest.
PROMPT = [100 + (7 * i) % 20000 for i in range(300)]
GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def spec() -> KVTransferSpec:
    return KVTransferSpec(side_channel_port=lease_side_channel_ports())


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(reference, decode server whose prompts all go to the one prefill server)."""
    root = tmp_path_factory.mktemp("adapter-root")
    model = ModelConfig.model_validate({
        **model_entry(BASE, "smollm2-135m-instruct", kv_cache_memory_bytes=64 * MiB),
        "disaggregation": {"min_prompt_tokens": 0},
        "lora": {"adapters": [{"name": CONFIGURED, "source": "random-lora:1"}], "adapter_root": str(root),
                 "max_lora_rank": 8}})
    path = resolve_source(model.source)
    shutil.copytree(random_lora(Path(path), 2), root / "b")
    reference = EngineServer(model, replica_id="ref", cpu_binding="1", model_path=path)
    # The prefill engine publishes its KV events, as a prefill pool routed on them does.
    events_port = free_port()
    prefill = PrefillServer(model.pool_model("prefill"), kv_transfer=spec(), replica_id="p0", cpu_binding="0",
                            model_path=path, kv_events_port=events_port)
    decode = DecodeServer(model.pool_model("decode"), kv_transfer=spec(), replica_id="d0", cpu_binding="1",
                          model_path=path, prefill_client=LocalPrefillClient([prefill]))
    index = KVEventIndex(block_size=prefill.engine.block_size)
    subscriber = KVEventSubscriber(index, topic=KV_EVENTS_TOPIC)
    subscriber.follow("p0", f"tcp://127.0.0.1:{events_port}")
    yield reference, decode, index
    subscriber.close()
    for server in (reference, prefill, decode):
        server.shutdown()


async def complete(server: EngineServer, name: str, request_id: str) -> tuple[int, dict, str | None]:
    """(status, body, prefill replica id) of one greedy completion of PROMPT under model ``name``."""
    body = {"model": name, "prompt": PROMPT, **GREEDY}
    request = ApiRequest(request_id, Endpoint.COMPLETIONS, json.dumps(body).encode())
    chunks = [chunk async for chunk in server.forward(request) if not chunk.heartbeat]
    return chunks[0].head.status_code, json.loads(b"".join(chunk.data for chunk in chunks)), \
        chunks[0].head.prefill_replica_id


async def test_an_adapters_request_is_prefilled_and_decoded_under_that_adapter(engines):
    reference, decode, _ = engines
    tokens = {}
    for name in (BASE, CONFIGURED, ROOTED):
        status, body, prefill_id = await complete(decode, name, f"pd-{name}")
        assert (status, prefill_id) == (200, "p0"), body  # the prompt's KV came from the prefill server
        _, expected, _ = await complete(reference, name, f"ref-{name}")
        tokens[name] = body["choices"][0]["token_ids"]
        assert tokens[name] == expected["choices"][0]["token_ids"], name
    # Each adapter changes the answer, so an adapter left out of either phase would have shown above.
    assert len({tuple(ids) for ids in tokens.values()}) == 3


async def test_a_missing_root_adapter_is_a_404_before_any_prefill(engines):
    _, decode, _ = engines
    status, body, prefill_id = await complete(decode, f"{BASE}:nope", "pd-nope")
    assert (status, body["error"]["code"], prefill_id) == (404, "model_not_found", None)


async def test_the_prefill_engines_kv_events_name_the_adapter_its_blocks_were_computed_under(engines):
    _, decode, index = engines
    await asyncio.sleep(0.5)  # ZMQ subscribers miss what is published before they connect
    prompt = [PROMPT[0] + 1, *PROMPT[1:]]  # a prompt no earlier test cached
    body = {"model": CONFIGURED, "prompt": prompt, **GREEDY}
    request = ApiRequest("pd-events", Endpoint.COMPLETIONS, json.dumps(body).encode())
    # Heartbeats (progress on a response not started yet, under load) carry no head.
    chunks = [chunk async for chunk in decode.forward(request) if not chunk.heartbeat]
    assert chunks[0].head.prefill_replica_id == "p0"

    def held(key) -> int:
        return index.match(index.hashes(key), ["p0"])[0].num_matched_blocks

    deadline = time.monotonic() + 10
    while held(AdapterTokens(CONFIGURED, prompt)) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    # 300 tokens: 2 full blocks of 128, held under the adapter and not under the base model.
    assert (held(AdapterTokens(CONFIGURED, prompt)), held(prompt)) == (2, 0)
