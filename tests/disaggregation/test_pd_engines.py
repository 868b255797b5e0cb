"""Prefill/decode disaggregation on real vLLM engines with NixlConnector, without Ray.

Two prefill and two decode servers run in this process, plus a colocated reference engine with the same
engine args. Pairings are pinned through LocalPrefillClient, so each topology (1P1D, 2P1D, 1P2D) is
exercised exactly. SmolLM2 in float32: its greedy output varies with the prompt (unlike the tiny random
model's), and float32 keeps it reproducible across engines.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from factories import MiB, model_entry
from fleetserve.deployments.disaggregated import decode_server
from fleetserve.deployments.disaggregated.decode_server import DecodeServer, LocalPrefillClient
from fleetserve.deployments.disaggregated.prefill_server import PrefillServer
from fleetserve.deployments.engine_server import EngineServer
from fleetserve.platform.api_types import ApiRequest, Endpoint
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import EngineRequestError
from fleetserve.platform.kv_transfer import KVTransferSpec, lease_side_channel_ports
from fleetserve.platform.model_store import resolve_source
from fleetserve.platform.output_lengths import bucket_index

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
pytest.importorskip("nixl", reason="disaggregation needs nixl (make install adds it)")

# vLLM's CPU block size is 128 tokens; prefill chunks are 256 tokens here.
BLOCK = 128
CHUNK = 256
# Shorter than a block, one short of / exactly at / one past block boundaries, longer than a chunk.
PROMPT_LENGTHS = [5, BLOCK - 1, BLOCK, 2 * BLOCK, 2 * BLOCK + 1, 2 * CHUNK + 100]
MAX_TOKENS = 12
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


def pd_model(min_prompt_tokens: int = 0) -> ModelConfig:
    entry = model_entry("smollm2", "smollm2-135m-instruct", kv_cache_memory_bytes=64 * MiB,
                        max_num_batched_tokens=CHUNK)
    return ModelConfig.model_validate({**entry, "disaggregation": {"min_prompt_tokens": min_prompt_tokens}})


def prompts(length_seed: int) -> list[list[int]]:
    """Token-id prompts of PROMPT_LENGTHS, distinct per seed so no topology reuses another's cache."""
    return [[100 + (7 * i + 13 * length_seed * (n + 1)) % 20000 for i in range(n)] for n in PROMPT_LENGTHS]


class Cluster:
    """The engines of this module: reference, prefill p0/p1, decode d0/d1."""

    def __init__(self) -> None:
        model = pd_model()
        path = resolve_source(model.source)
        self.reference = EngineServer(model, replica_id="ref", cpu_binding="1", model_path=path)
        self.prefill = [PrefillServer(model.pool_model("prefill"), kv_transfer=self._spec(), replica_id=f"p{i}",
                                      cpu_binding="0", model_path=path) for i in range(2)]
        self.decode = [DecodeServer(model.pool_model("decode"), kv_transfer=self._spec(), replica_id=f"d{i}",
                                    cpu_binding="1", model_path=path,
                                    prefill_client=LocalPrefillClient(self.prefill)) for i in range(2)]

    @staticmethod
    def _spec() -> KVTransferSpec:
        return KVTransferSpec(side_channel_port=lease_side_channel_ports())

    def all(self) -> list[EngineServer]:
        return [self.reference, *self.prefill, *self.decode]

    def shutdown(self) -> None:
        for server in self.all():
            server.shutdown()


@pytest.fixture(scope="module")
def cluster():
    started = Cluster()
    yield started
    started.shutdown()


def completion(request_id: str, prompt: list[int], **options) -> ApiRequest:
    body = {"model": "smollm2", "prompt": prompt, "return_token_ids": True, **(options or GREEDY)}
    return ApiRequest(request_id, Endpoint.COMPLETIONS, json.dumps(body).encode())


async def respond(server: EngineServer, request: ApiRequest) -> tuple[int, dict, str | None]:
    """(status, parsed body, prefill replica id) of one non-streamed request (its heartbeats left out, as the
    ingress leaves them out)."""
    chunks = [chunk async for chunk in server.forward(request) if not chunk.heartbeat]
    head = chunks[0].head
    return head.status_code, json.loads(b"".join(chunk.data for chunk in chunks)), head.prefill_replica_id


async def run(server: EngineServer, prompt: list[int], request_id: str, **options):
    """(token ids, prefill replica ids seen) of one request."""
    status, body, prefill_id = await respond(server, completion(request_id, prompt, **options))
    assert status == 200, body
    return body["choices"][0]["token_ids"], {prefill_id}


async def wait_idle(servers, timeout_s: float = 20.0) -> list:
    """Every server's stats once all report nothing running or waiting and no KV in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [server.engine.stats() for server in servers]
        if all(s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


@pytest.mark.parametrize(("topology", "prefill_order", "decode_ids"), [
    ("1P1D", [0], [0]),
    ("2P1D", [0, 1], [0]),
    ("1P2D", [0], [0, 1]),
])
async def test_greedy_output_matches_colocated(cluster, topology, prefill_order, decode_ids):
    batch = prompts(length_seed=len(topology) + sum(prefill_order) * 3 + sum(decode_ids) * 5)
    reference = await asyncio.gather(*(run(cluster.reference, p, f"ref-{topology}-{i}") for i, p in enumerate(batch)))
    for decode in cluster.decode:
        decode.prefill_client = LocalPrefillClient(cluster.prefill, order=prefill_order)
    before = [d.engine.stats() for d in cluster.decode]
    outputs = await asyncio.gather(*(
        run(cluster.decode[decode_ids[i % len(decode_ids)]], p, f"{topology}-{i}") for i, p in enumerate(batch)))
    assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in reference]
    # Each request names the prefill replica that served it, in the pinned order.
    assert [ids for _, ids in outputs] == [{f"p{prefill_order[i % len(prefill_order)]}"} for i in range(len(batch))]
    # The KV really moved: the decode engines prefilled nothing themselves.
    after = await wait_idle(cluster.all())
    decode_after = after[3:]
    moved = sum(a.num_external_prompt_tokens - b.num_external_prompt_tokens for a, b in zip(decode_after, before))
    computed = sum(a.num_computed_prompt_tokens - b.num_computed_prompt_tokens for a, b in zip(decode_after, before))
    assert (moved, computed) == (sum(PROMPT_LENGTHS), 0)
    assert [(s.num_running, s.kv_cache_usage) for s in after] == [(0, 0.0)] * 5


async def test_short_prompts_skip_remote_prefill(cluster):
    decode = cluster.decode[0]
    decode.prefill_client = LocalPrefillClient(cluster.prefill)
    decode.settings = pd_model(min_prompt_tokens=BLOCK).disaggregation
    try:
        short, long = prompts(length_seed=11)[0], prompts(length_seed=11)[2]
        before = decode.engine.stats()
        _, short_prefill = await run(decode, short, "short")
        _, long_prefill = await run(decode, long, "long")
        after = decode.engine.stats()
    finally:
        decode.settings = pd_model().disaggregation
    assert short_prefill == {None} and long_prefill in ({"p0"}, {"p1"})
    # 5 tokens prefilled on the decode replica; the 128-token prompt's KV came from prefill.
    assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == len(short)
    assert after.num_external_prompt_tokens - before.num_external_prompt_tokens == len(long)


# A user turn of about 300 tokens: past BLOCK, so min_prompt_tokens=BLOCK sends it to the prefill pool. Each
# endpoint names itself first, so neither finds the other's blocks in a prefix cache.
LONG_TEXT = " ".join(f"Shelf {i} holds {3 * i + 1} red boxes." for i in range(30)) + " Summarise the inventory."
# The same request on each endpoint vLLM can disaggregate besides chat and completions.
API_REQUESTS = {
    Endpoint.MESSAGES: {"model": "smollm2", "max_tokens": MAX_TOKENS, "temperature": 0, "system": "Be brief.",
                        "messages": [{"role": "user",
                                      "content": [{"type": "text", "text": f"Messages. {LONG_TEXT}"}]}]},
    Endpoint.RESPONSES: {"model": "smollm2", "max_output_tokens": MAX_TOKENS, "temperature": 0,
                         "instructions": "Be brief.", "input": f"Responses. {LONG_TEXT}"},
}


def answer_text(endpoint: Endpoint, body: dict) -> str:
    if endpoint is Endpoint.MESSAGES:
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


@pytest.mark.parametrize("endpoint", list(API_REQUESTS))
async def test_anthropic_messages_and_responses_are_prefilled_remotely_with_the_same_answer(cluster, endpoint):
    decode = cluster.decode[0]
    decode.prefill_client = LocalPrefillClient(cluster.prefill, order=[1])
    decode.settings = pd_model(min_prompt_tokens=BLOCK).disaggregation
    body = json.dumps(API_REQUESTS[endpoint]).encode()
    try:
        status, reference, _ = await respond(cluster.reference, ApiRequest(f"ref-{endpoint.name}", endpoint, body))
        before = decode.engine.stats()
        pd_status, answer, prefill_id = await respond(decode, ApiRequest(f"pd-{endpoint.name}", endpoint, body))
        after = decode.engine.stats()
    finally:
        decode.settings = pd_model().disaggregation
    assert (status, pd_status, prefill_id) == (200, 200, "p1"), answer
    assert answer_text(endpoint, answer) == answer_text(endpoint, reference) != ""
    # The decode engine computed no prompt token itself: all of them came from the prefill replica.
    moved = after.num_external_prompt_tokens - before.num_external_prompt_tokens
    assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == 0 and moved > BLOCK


def recorded_priorities(monkeypatch, server: EngineServer) -> list[int]:
    """The priority of each request vLLM's app gives the server's engine, as the engine gets it."""
    seen: list[int] = []
    llm = server.engine._llm
    generate = llm.generate

    def recorded(*args, **kwargs):
        seen.append(kwargs.get("priority", 0))
        return generate(*args, **kwargs)

    monkeypatch.setattr(llm, "generate", recorded)
    return seen


PRIORITY_REQUESTS = {
    **API_REQUESTS,
    Endpoint.CHAT: {"model": "smollm2", "max_tokens": MAX_TOKENS, "messages": [
        {"role": "user", "content": f"Chat. {LONG_TEXT}"}]},
    Endpoint.COMPLETIONS: {"model": "smollm2", "max_tokens": MAX_TOKENS, "prompt": f"Completions. {LONG_TEXT}"},
}


async def test_the_platforms_priority_reaches_both_engines_on_every_generating_path(cluster, monkeypatch):
    decode = cluster.decode[0]
    decode.prefill_client = LocalPrefillClient(cluster.prefill, order=[1])
    decode.settings = pd_model(min_prompt_tokens=BLOCK).disaggregation
    decode_seen, prefill_seen = recorded_priorities(monkeypatch, decode), recorded_priorities(monkeypatch,
                                                                                               cluster.prefill[1])
    try:
        for index, (endpoint, body) in enumerate(PRIORITY_REQUESTS.items()):
            request = ApiRequest(f"priority-{endpoint.name}", endpoint, json.dumps(body).encode(), priority=7 + index)
            status, answer, prefill_id = await respond(decode, request)
            assert (status, prefill_id) == (200, "p1"), answer
    finally:
        decode.settings = pd_model().disaggregation
    # Messages, Responses, chat, completions in that order, each prefilled on p1 and decoded here: vLLM reads
    # its priority header on each (Anthropic's through the chat request it converts the message into).
    assert decode_seen == prefill_seen == [7, 8, 9, 10]


async def test_a_non_streamed_answer_reports_its_progress_before_it_is_whole(cluster, monkeypatch):
    # vLLM gives a non-streamed request's caller only its final output; the replica reads the tokens its
    # engine counts meanwhile and says, in heartbeats, that the request is progressing.
    monkeypatch.setattr("fleetserve.platform.relay.HEARTBEAT_S", 0.05)
    request = completion("heartbeats", prompts(length_seed=17)[0], max_tokens=64, temperature=0.0, ignore_eos=True)
    chunks = [chunk async for chunk in cluster.reference.forward(request)]
    beats = [chunk for chunk in chunks if chunk.heartbeat]
    answer = json.loads(b"".join(chunk.data for chunk in chunks if not chunk.heartbeat))
    # 64 tokens take over a second on this CPU: many 0.05 s periods in which the count grew. The heartbeats
    # all come before the response, and carry nothing.
    assert len(beats) > 0 and all(chunk.heartbeat for chunk in chunks[:len(beats)])
    assert {(chunk.data, chunk.head) for chunk in beats} == {(b"", None)}
    assert answer["usage"]["completion_tokens"] == 64


async def test_background_response_without_vllms_store_is_refused_before_any_prefill(cluster):
    decode = cluster.decode[0]
    decode.prefill_client = LocalPrefillClient(cluster.prefill, order=[0])
    prefill_before = cluster.prefill[0].engine.stats().num_computed_prompt_tokens
    body = json.dumps({**API_REQUESTS[Endpoint.RESPONSES], "background": True}).encode()
    status, answer, prefill_id = await respond(decode, ApiRequest("background", Endpoint.RESPONSES, body))
    # vLLM's own 400 (its response store is off by default), from the decode replica, with no prefill spent.
    assert (status, prefill_id, answer["error"]["param"]) == (400, None, "background")
    assert cluster.prefill[0].engine.stats().num_computed_prompt_tokens == prefill_before


@pytest.mark.parametrize("how", ["stop_string", "abort"])
async def test_early_end_frees_both_sides(cluster, how):
    decode = cluster.decode[1]
    decode.prefill_client = LocalPrefillClient(cluster.prefill, order=[1])
    prompt = prompts(length_seed=17)[-1]
    if how == "stop_string":
        # The reference tells which text the greedy output reaches after a few tokens.
        _, reference, _ = await respond(cluster.reference, completion("ref-stop", prompt))
        text = reference["choices"][0]["text"]
        stop = text[len(text) // 2:][:3]
        tokens, _ = await run(decode, prompt, "stopped", max_tokens=200, temperature=0.0, stop=[stop])
        assert 0 < len(tokens) < MAX_TOKENS
    else:
        stream = decode.forward(completion("aborted", prompt, max_tokens=300, temperature=0.0, ignore_eos=True,
                                           stream=True))
        async for chunk in stream:
            if b'"text"' in chunk.data:
                break
        await stream.aclose()
    stats = await wait_idle([decode, cluster.prefill[1]])
    assert [(s.num_running, s.num_waiting, s.kv_cache_usage) for s in stats] == [(0, 0, 0.0)] * 2


class FailingPool:
    """A prefill pool Serve still lists (failing, not gone) whose every prefill raises ``error``; ``avoided``
    holds what each call's routing hints told its router to avoid, in call order."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.avoided: list[frozenset[str]] = []

    async def prefill(self, request):
        self.avoided.append(request.routing.avoid_replica_ids)
        raise self.error

    async def num_running_replicas(self):
        return 1


async def test_failing_prefill_pool_is_a_clear_503(cluster):
    decode = cluster.decode[0]
    decode.prefill_client = pool = FailingPool(ConnectionError("prefill replica is gone"))
    with pytest.raises(EngineRequestError) as raised:
        await run(decode, prompts(length_seed=19)[2], "doomed")
    assert raised.value.status_code == 503 and "prefill failed on 2 attempt(s)" in raised.value.message
    assert (raised.value.code, raised.value.retry_after_s) == ("prefill_unavailable", 10)  # HEALTH_CHECK_PERIOD_S
    assert len(pool.avoided) == 2  # max_prefill_attempts
    stats = await wait_idle([decode])
    assert (stats[0].num_running, stats[0].kv_cache_usage) == (0, 0.0)


async def test_a_prefill_retry_avoids_the_replica_whose_engine_died(cluster):
    from fleetserve.platform.engine import EngineDeadError

    decode = cluster.decode[0]
    decode.prefill_client = pool = FailingPool(EngineDeadError("p0"))
    with pytest.raises(EngineRequestError) as raised:
        await run(decode, prompts(length_seed=19)[2], "dead-engine")
    # The second attempt asks the prefill pool's router for any replica but p0.
    assert pool.avoided == [frozenset(), frozenset({"p0"})]
    assert raised.value.status_code == 503 and "replica p0's engine has died" in raised.value.message


async def test_a_decode_replica_whose_engine_died_refuses_before_any_prefill(cluster, monkeypatch):
    from fleetserve.platform.engine import EngineDeadError

    decode = cluster.decode[0]
    # A prefill for a decode engine that cannot continue it would hold KV for nothing.
    decode.prefill_client = pool = FailingPool(AssertionError("prefilled for a dead decode engine"))
    monkeypatch.setattr(type(decode.engine), "errored", property(lambda engine: engine is decode.engine))
    with pytest.raises(EngineDeadError):
        await respond(decode, completion("dead-decode", prompts(length_seed=19)[2]))
    assert len(pool.avoided) == 0  # no prefill was asked for


class VanishingPool:
    """A prefill pool whose replicas are gone: Serve would queue a prefill until one runs (it never answers
    here). ``running`` is the replica count it reports on each look, the last one repeated."""

    def __init__(self, *running: int) -> None:
        self.running = list(running)
        self.num_calls = self.num_cancelled = 0

    async def prefill(self, request):
        self.num_calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise

    async def num_running_replicas(self):
        return self.running.pop(0) if len(self.running) > 1 else self.running[0]


def local_prefills(decode: DecodeServer) -> float:
    labels = {"model_name": "smollm2", "replica": decode.replica_id, "pool": "decode"}
    return decode.metrics.registry.get_sample_value("fleetserve_local_prefills_total", labels)


@pytest.mark.parametrize("running", [(0,), (1, 1, 0)], ids=["empty_before", "emptied_while_waiting"])
async def test_prefill_pool_without_replicas_prefills_on_the_decode_replica(cluster, monkeypatch, running):
    monkeypatch.setattr(decode_server, "POOL_CHECK_PERIOD_S", 0.05)
    decode, pool = cluster.decode[1], VanishingPool(*running)
    decode.prefill_client = pool
    prompt = prompts(length_seed=23 + len(running))[3]  # its own prompt: no prefix cache hit from the other case
    reference, _ = await run(cluster.reference, prompt, "ref-vanished")
    before, counted = decode.engine.stats(), local_prefills(decode)
    tokens, prefill_ids = await run(decode, prompt, f"vanished-{len(running)}")
    assert (tokens, prefill_ids) == (reference, {None})
    # Sent to the pool only while it reported a replica (the first look passes, the second or third finds
    # none), and that call was abandoned.
    assert (pool.num_calls, pool.num_cancelled) == ((0, 0) if running == (0,) else (1, 1))
    after = await wait_idle([decode])
    assert after[0].num_computed_prompt_tokens - before.num_computed_prompt_tokens == len(prompt)
    assert local_prefills(decode) - counted == 1


async def test_prefill_pool_without_replicas_refuses_at_once_when_configured(cluster):
    decode, pool = cluster.decode[1], VanishingPool(0)
    decode.prefill_client = pool
    decode.settings = decode.settings.model_copy(update={"prefill_pool_empty": "refuse"})
    try:
        with pytest.raises(EngineRequestError) as raised:
            await run(decode, prompts(length_seed=25)[2], "refused-empty")
    finally:
        decode.settings = pd_model().disaggregation
    assert raised.value.status_code == 503 and "no running replica" in raised.value.message
    assert (raised.value.code, raised.value.retry_after_s) == ("prefill_unavailable", 10)  # HEALTH_CHECK_PERIOD_S
    assert pool.num_calls == 0


async def test_too_long_prompt_gets_vllms_400_and_holds_no_kv(cluster):
    decode = cluster.decode[0]
    decode.prefill_client = LocalPrefillClient(cluster.prefill, order=[0])
    before = decode.engine.stats()
    status, body, prefill_id = await respond(decode, completion("too-long", [200] * 1030, max_tokens=10))
    # vLLM's own 400, from the prefill replica that refused it: 1030 prompt tokens > max_model_len 1024.
    assert (status, prefill_id) == (400, "p0")
    assert "maximum context length is 1024 tokens" in body["error"]["message"]
    stats = await wait_idle([decode, cluster.prefill[0]])
    assert [(s.num_running, s.kv_cache_usage) for s in stats] == [(0, 0.0)] * 2
    assert stats[0].num_computed_prompt_tokens == before.num_computed_prompt_tokens


async def test_autoscaling_signals_put_prefill_work_on_the_pool_that_does_it(cluster):
    decode, prefill = cluster.decode[0], cluster.prefill[0]
    decode.prefill_client = LocalPrefillClient(cluster.prefill, order=[0])
    for server in (decode, prefill):
        server.autoscaling_report()  # opens the interval the next rates cover
    before = [server.engine.stats() for server in (decode, prefill)]
    tasks = [asyncio.ensure_future(run(decode, prompt, f"signals-{i}")) for i, prompt in enumerate(prompts(29))]
    peaks = [0, 0]
    while not all(task.done() for task in tasks):
        peaks = [max(peak, server.engine.num_pending_prompt_tokens) for peak, server in zip(peaks, (decode, prefill))]
        await asyncio.sleep(0.002)
    await asyncio.gather(*tasks)
    signals = [server.autoscaling_report() for server in (decode, prefill)]
    computed = [a.num_computed_prompt_tokens - b.num_computed_prompt_tokens
                for a, b in zip((decode.engine.stats(), prefill.engine.stats()), before)]
    # Every prompt's KV came from p0: the backlog and the computed tokens are p0's, none are d0's.
    assert peaks[0] == 0 and 0 < peaks[1] <= sum(PROMPT_LENGTHS)
    assert computed == [0, sum(PROMPT_LENGTHS)]
    assert signals[0].prompt_tokens_per_s == 0 and signals[1].prompt_tokens_per_s > 0
    assert [s.num_pending_prompt_tokens for s in signals] == [0, 0]
    assert [s.max_num_seqs for s in signals] == [32, 32]  # model_entry's, as each engine's scheduler holds it
    # The decode replica finished all six requests at their 12 tokens: the output lengths the SLO policy
    # reads are there, and only there.
    finished = [a - b for a, b in zip(decode.engine.stats().output_length_counts, before[0].output_length_counts)]
    assert (finished[bucket_index(MAX_TOKENS)], sum(finished)) == (len(PROMPT_LENGTHS), len(PROMPT_LENGTHS))
    lengths = signals[0].finished_per_s_by_length
    assert [i for i, rate in enumerate(lengths) if rate > 0] == [bucket_index(MAX_TOKENS)]
