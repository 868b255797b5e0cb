"""The KV-event prefix index: exact bookkeeping on hand-built vLLM events, then a real engine's event stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from factories import MiB, model_entry
from fleetserve.router.replica.kv_events import AdapterTokens, KVEventIndex, KVEventSubscriber, token_block_hashes

kv_events = pytest.importorskip("vllm.distributed.kv_events")


def stored(block_hashes, tokens, parent=None, block_size=4, lora_id=None, lora_name=None):
    return kv_events.BlockStored(block_hashes=block_hashes, parent_block_hash=parent, token_ids=tokens,
                                 block_size=block_size, lora_id=lora_id, medium="GPU", lora_name=lora_name)


def removed(block_hashes):
    return kv_events.BlockRemoved(block_hashes=block_hashes, medium="GPU")


def matched(index: KVEventIndex, tokens: list[int] | AdapterTokens, replica_id: str = "a") -> tuple[int, int]:
    match = index.match(index.hashes(tokens), [replica_id])[0]
    return match.num_matched_blocks, match.num_blocks


def test_stored_chains_match_prompts_block_by_block():
    index = KVEventIndex(block_size=4)
    # Engine blocks 101 and 102 hold tokens 1-4 and 5-8; 103, a child of 102, holds 9-12.
    index.apply("a", stored([101, 102], [1, 2, 3, 4, 5, 6, 7, 8]))
    index.apply("a", stored([103], [9, 10, 11, 12], parent=102))
    # 13 tokens: 3 full blocks (the 13th token's block is partial and never cached), all held.
    assert matched(index, list(range(1, 14))) == (3, 3)
    # The same first block, a different second: 1 of 2.
    assert matched(index, [1, 2, 3, 4, 7, 7, 7, 7]) == (1, 2)
    # The same tokens in a later position do not match: the chain includes everything before.
    assert matched(index, [5, 6, 7, 8]) == (0, 1)
    assert matched(index, [1, 2, 3, 4], replica_id="b") == (0, 1)
    assert index.num_blocks("a") == 3


def test_removed_blocks_break_the_chain_where_they_were():
    index = KVEventIndex(block_size=4)
    index.apply("a", stored([101, 102, 103], list(range(1, 13))))
    index.apply("a", removed([102]))
    # Block 3 is still held, but a prompt's match stops at the first missing block.
    assert matched(index, list(range(1, 13))) == (1, 3)
    index.apply("a", kv_events.AllBlocksCleared())
    assert matched(index, list(range(1, 13))) == (0, 3) and index.num_blocks("a") == 0


def test_a_prefix_stored_twice_stays_held_until_both_are_removed():
    index = KVEventIndex(block_size=4)
    index.apply("a", stored([101], [1, 2, 3, 4]))
    index.apply("a", stored([201], [1, 2, 3, 4]))  # recomputed into another block
    index.apply("a", removed([101]))
    assert matched(index, [1, 2, 3, 4]) == (1, 1)
    index.apply("a", removed([201]))
    assert matched(index, [1, 2, 3, 4]) == (0, 1)


def test_orphans_adapters_and_gone_replicas_are_not_indexed():
    index = KVEventIndex(block_size=4)
    # Parent 999 was never seen (a missed event): 2 blocks cannot be placed.
    index.apply("a", stored([101, 102], list(range(1, 9)), parent=999))
    # An adapter's block from an engine that does not name the adapter: no prompt could be keyed to it.
    index.apply("a", stored([103], [1, 2, 3, 4], lora_id=7))
    assert index.num_orphan_blocks == 2 and index.num_blocks("a") == 0
    index.apply("b", stored([104], [1, 2, 3, 4]))
    index.retain(["a"])
    assert matched(index, [1, 2, 3, 4], replica_id="b") == (0, 1)


def test_an_adapters_blocks_match_only_prompts_under_that_adapter():
    index = KVEventIndex(block_size=4)
    index.apply("a", stored([101], [1, 2, 3, 4], lora_id=1, lora_name="sql"))
    index.apply("a", stored([102], [5, 6, 7, 8], parent=101, lora_id=1, lora_name="sql"))
    tokens = list(range(1, 9))
    assert matched(index, AdapterTokens("sql", tokens)) == (2, 2)
    # The same tokens under the base model or another adapter hold other KV.
    assert matched(index, tokens) == (0, 2)
    assert matched(index, AdapterTokens("chat", tokens)) == (0, 2)
    index.apply("a", stored([201], [1, 2, 3, 4]))
    assert (matched(index, tokens), matched(index, AdapterTokens("sql", tokens))) == ((1, 2), (2, 2))


def test_block_hashes_chain_over_full_blocks_only():
    # 9 tokens, blocks of 4: two full blocks; the second hash depends on the first block's tokens.
    assert len(token_block_hashes(list(range(9)), 4)) == 2
    assert token_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)[1] != token_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1]


@pytest.fixture(scope="module")
def engine_with_events():
    from fleetserve.loadtest.local_server import free_port
    from fleetserve.platform.config import ModelConfig
    from fleetserve.platform.engine import Engine
    from fleetserve.platform.model_store import resolve_source

    port = free_port()
    # 1 MiB of float32 KV for the tiny model (2 layers x 1 KV head x 64 dims x K and V x 4 bytes = 1 KiB
    # per token) is 8 blocks of 128 tokens: a few prompts evict the first one's blocks.
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    model = ModelConfig.model_validate(model_entry("tiny", max_model_len=512, kv_cache_memory_bytes=1 * MiB,
                                                   extra={"kv_events_config": events}))
    engine = Engine.create(model, resolve_source(model.source))
    index = KVEventIndex(block_size=engine.block_size)
    subscriber = KVEventSubscriber(index, topic="kv")
    subscriber.follow("r0", f"tcp://127.0.0.1:{port}")
    yield engine, index, subscriber
    subscriber.close()
    engine.shutdown()


async def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.mark.slow
def test_real_engine_events_track_its_prefix_cache(engine_with_events):
    from fleetserve.platform.engine import SamplingOptions

    engine, index, subscriber = engine_with_events
    block_size = engine.block_size

    async def generate(prompt: list[int], request_id: str) -> None:
        async for _ in engine.generate(prompt, SamplingOptions(max_tokens=2), request_id):
            pass

    def held(prompt: list[int]) -> int:
        return index.match(index.hashes(prompt), ["r0"])[0].num_matched_blocks

    async def scenario() -> None:
        # ZMQ subscribers miss what is published before they connect; give the connection a moment.
        await asyncio.sleep(0.5)
        first = [(7 * i) % 2000 + 10 for i in range(2 * block_size + 44)]   # 300 tokens: 2 full blocks
        await generate(first, "first")
        assert await wait_for(lambda: held(first) == 2), (held(first), subscriber.num_events)
        # A prompt sharing only the first block matches 1 block before it is even sent.
        assert held(first[:block_size] + [5] * block_size) == 1
        # Other prompts fill the 8-block cache; vLLM evicts the least recently used blocks and says so.
        for n in range(4):
            await generate([(11 * i + n) % 2000 + 10 for i in range(300)], f"other-{n}")
        assert await wait_for(lambda: held(first) < 2), held(first)

    asyncio.run(scenario())
    assert subscriber.num_gaps == 0 and index.num_orphan_blocks == 0


def test_routed_blocks_count_until_their_ttl_unless_events_confirm():
    from fleetserve.router.replica.kv_events import PENDING_TTL_S

    now = [0.0]
    index = KVEventIndex(block_size=4, clock=lambda: now[0])
    tokens = list(range(1, 9))
    index.insert("a", index.hashes(tokens))
    # Just routed: both blocks count on a, so the next request of the burst follows.
    assert matched(index, tokens) == (2, 2)
    # The engine stored only the first block (the request was aborted mid-prefill, say).
    index.apply("a", stored([101], tokens[:4]))
    now[0] = PENDING_TTL_S + 0.1
    assert matched(index, tokens) == (1, 2)


def test_no_block_size_yet_matches_nothing():
    index = KVEventIndex()
    assert index.hashes(list(range(300))) == []
    index.block_size = 4
    assert len(index.hashes(list(range(9)))) == 2


def test_event_keys_render_chats_with_the_replicas_chat_template():
    from fleetserve.platform.api_types import ApiRequest, Endpoint, RoutingHints
    from fleetserve.router.replica.serve_adapter import EventKeys

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "hello there"}]
    request = ApiRequest("req-1", Endpoint.CHAT, b"{}", routing=RoutingHints(messages=messages))
    keys, own = EventKeys("tiny-random-llama", chat_template=template), EventKeys("tiny-random-llama")
    try:
        # Exactly the ids of the template's text, which differ from the model's own (ChatML) rendering.
        assert keys.key(request) == keys.tokenizer.encode("[user] hello there\n", add_special_tokens=False)
        assert own.key(request) != keys.key(request)
    finally:
        keys.subscriber.close()
        own.subscriber.close()


def test_event_keys_key_an_adapters_prompt_under_that_adapter():
    from fleetserve.platform.api_types import ApiRequest, Endpoint, RoutingHints
    from fleetserve.router.replica.serve_adapter import EventKeys

    keys = EventKeys("tiny-random-llama")
    try:
        request = ApiRequest("req-1", Endpoint.COMPLETIONS, b"{}", routing=RoutingHints(prompt=[5, 6, 7],
                                                                                        adapter="tiny-sql"))
        assert keys.key(request) == AdapterTokens("tiny-sql", [5, 6, 7])
        assert keys.key(ApiRequest("req-2", Endpoint.COMPLETIONS, b"{}", routing=RoutingHints(prompt=[5]))) == [5]
    finally:
        keys.subscriber.close()


@pytest.mark.slow
def test_a_real_engines_adapter_blocks_are_keyed_by_the_adapters_served_name(tmp_path):
    import json

    from fleetserve.deployments.engine_server import EngineServer
    from fleetserve.loadtest.local_server import free_port
    from fleetserve.platform.api_types import ApiRequest, Endpoint
    from fleetserve.platform.config import ModelConfig
    from fleetserve.platform.model_store import resolve_source

    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    model = ModelConfig.model_validate({**model_entry("tiny", extra={"kv_events_config": events}), "lora": {
        "adapters": [{"name": "tiny-sql", "source": "random-lora:1"}], "max_lora_rank": 8}})
    server = EngineServer(model, replica_id="r0", cpu_binding="1", model_path=resolve_source(model.source))
    subscriber = None
    try:
        index = KVEventIndex(block_size=server.engine.block_size)
        subscriber = KVEventSubscriber(index, topic="kv")
        subscriber.follow("r0", f"tcp://127.0.0.1:{port}")
        prompt = [(7 * i) % 2000 + 10 for i in range(2 * index.block_size + 44)]  # 2 full blocks

        async def scenario() -> None:
            await asyncio.sleep(0.5)  # ZMQ subscribers miss what is published before they connect
            body = {"model": "tiny-sql", "prompt": prompt, "max_tokens": 2}
            request = ApiRequest("sql-1", Endpoint.COMPLETIONS, json.dumps(body).encode())
            # Heartbeats (progress on a response not started yet, under load) carry no head.
            chunks = [chunk async for chunk in server.forward(request) if not chunk.heartbeat]
            assert chunks[0].head.status_code == 200
            assert await wait_for(lambda: matched(index, AdapterTokens("tiny-sql", prompt), "r0") == (2, 2))

        asyncio.run(scenario())
        # The adapter's blocks are not the base model's.
        assert matched(index, prompt, "r0") == (0, 2)
    finally:
        if subscriber is not None:
            subscriber.close()
        server.shutdown()
