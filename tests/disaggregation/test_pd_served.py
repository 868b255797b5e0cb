"""A disaggregated model served through Ray Serve: 2 prefill and 2 decode replicas of the tiny model.

Clients use the same OpenAI API as for colocated models; faults are injected by killing replicas.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import cluster_helpers
from cluster_helpers import kill
from conftest import Served
from factories import model_entry
from fleetserve.deployments.ingress.protocol import HEADER_POOL, HEADER_PREFILL_REPLICA, HEADER_REPLICA
from fleetserve.deployments.ingress.server import HEADER_ADAPTER_REPLICAS
from fleetserve.platform.config import parse_config

pytestmark = [pytest.mark.slow]
pytest.importorskip("nixl", reason="disaggregation needs nixl (make install adds it)")

MODEL = "pd-tiny"
# 543 tokens: prefill is real work for the tiny model, with room for 450 more in its 1024-token context.
LONG_PROMPT = " ".join(f"item {i} of the inventory list" for i in range(50))


@pytest.fixture(scope="module")
def pd_app(served) -> Served:
    from ray import serve

    from fleetserve.deployments.builders import build_app

    pool = {"replicas": 2, "cpu_binding": ["0", "1"]}
    config = parse_config({"models": [{
        **model_entry(MODEL), "resources": {"num_cpus": 0.1}, "lora": {"max_lora_rank": 8},
        # The prefill pool follows its engines' KV events (colocated kv_events routing: the multinode tests).
        "routing": {"prefix_source": "kv_events"},
        "disaggregation": {"prefill": pool, "decode": pool, "max_prefill_attempts": 3, "prefill_timeout_s": 30}}]})
    serve.run(build_app(config), name="pd", route_prefix="/pd")
    yield Served(base_url=f"{served.base_url}/pd", config=config, handles={})
    # The kill tests leave Serve starting a replacement. Deleting at once stops it with its engine's processes
    # (serve.delete returns once the replicas are gone; a replica deleted mid-start left no vLLM process behind
    # when tried), where waiting for it to come up first cost ~55 s of the suite.
    serve.delete("pd")


def wait_all_idle(app: Served) -> dict:
    """The PD model's gauges once all 4 replicas are idle (nothing running or waiting, no KV in use)."""
    return cluster_helpers.wait_all_idle(app.base_url, MODEL, num_replicas=4)


def replica_actors(pool: str) -> list[str]:
    """Names of the live Serve replica actors of one PD pool."""
    return cluster_helpers.replica_actors(f"prefill-{MODEL}" if pool == "prefill" else f"engine-{MODEL}")


def completion(app: Served, prompt: str = LONG_PROMPT, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{app.base_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


def test_same_api_and_output_as_colocated(pd_app, served):
    import openai

    client = openai.OpenAI(base_url=f"{pd_app.base_url}/v1", api_key="unused")
    colocated = openai.OpenAI(base_url=served.api_url, api_key="unused")
    for prompt in ("Hello", LONG_PROMPT):
        pd = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        # The suite's `tiny` model has the same source and engine args, served colocated.
        reference = colocated.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert pd.choices[0].text == reference.choices[0].text
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}],
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 10
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def answer_texts(path: str, body: dict) -> list[str]:
    """The text parts of an Anthropic message or a Responses output (their ids differ per response)."""
    if path == "/v1/messages":
        return [block["text"] for block in body["content"] if block["type"] == "text"]
    return [part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"]]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"max_tokens": 6, "messages": [{"role": "user", "content": LONG_PROMPT}]}),
    ("/v1/responses", {"max_output_tokens": 6, "input": LONG_PROMPT}),
])
def test_anthropic_and_responses_requests_are_disaggregated_through_serve(pd_app, served, path, body):
    pd = httpx.post(f"{pd_app.base_url}{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    reference = httpx.post(f"{served.base_url}{path}", json={"model": "tiny", "temperature": 0, **body}, timeout=120)
    assert (pd.status_code, reference.status_code) == (200, 200), pd.text
    assert pd.headers[HEADER_POOL] == "decode" and pd.headers[HEADER_PREFILL_REPLICA]
    # The same greedy answer as the suite's colocated tiny model (same source and engine args).
    assert answer_texts(path, pd.json()) == answer_texts(path, reference.json()) != []


def test_an_adapter_loaded_at_run_time_is_served_by_both_pools(pd_app):
    change = {"lora_name": "pd-tiny-c", "lora_path": "random-lora:3"}
    loaded = httpx.post(f"{pd_app.base_url}/v1/load_lora_adapter", json=change, timeout=120)
    # The admin API returns once every replica serves it: 2 prefill and 2 decode.
    assert (loaded.status_code, loaded.headers[HEADER_ADAPTER_REPLICAS]) == (200, "4/4"), loaded.text
    try:
        base, adapted = completion(pd_app), completion(pd_app, model="pd-tiny-c")
        assert adapted.status_code == 200, adapted.text
        assert adapted.headers[HEADER_PREFILL_REPLICA]  # prefilled in the prefill pool
        # Exactness against a colocated engine with the adapter is test_pd_lora.py's; here, that it took effect.
        assert adapted.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    finally:
        unloaded = httpx.post(f"{pd_app.base_url}/v1/unload_lora_adapter", json={"lora_name": "pd-tiny-c"},
                              timeout=120)
        assert unloaded.status_code == 200, unloaded.text


def test_anthropic_stream_is_disaggregated_and_ends_with_message_stop(pd_app):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": LONG_PROMPT}]}
    with httpx.stream("POST", f"{pd_app.base_url}/v1/messages", json=body, timeout=120) as response:
        events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
        assert response.status_code == 200 and response.headers[HEADER_PREFILL_REPLICA]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events


def test_headers_name_both_replicas_and_load_spreads_over_pools(pd_app):
    async def one(index: int) -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            return await client.post(f"{pd_app.base_url}/v1/completions", json={
                "model": MODEL, "prompt": f"{index} {LONG_PROMPT}", "max_tokens": 16, "temperature": 0})

    async def burst() -> list[httpx.Response]:
        return await asyncio.gather(*(one(i) for i in range(12)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 12
    assert {r.headers[HEADER_POOL] for r in responses} == {"decode"}
    # xPyD: both prefill and both decode replicas served some of the 12 concurrent requests.
    assert len({r.headers[HEADER_PREFILL_REPLICA] for r in responses}) == 2
    assert len({r.headers[HEADER_REPLICA] for r in responses}) == 2
    assert not {r.headers[HEADER_PREFILL_REPLICA] for r in responses} & {r.headers[HEADER_REPLICA] for r in responses}


def test_prefill_pool_is_routed_cache_aware(pd_app):
    # (group, decode replica) -> prefill replicas that served it
    prefill_replicas: dict[tuple[int, str], set[str]] = {}
    for group in range(2):
        prefix = " ".join(f"group {group} shared context line {i}" for i in range(40))
        for index in range(4):
            response = completion(pd_app, prompt=f"{prefix} question {index}", max_tokens=2)
            assert response.status_code == 200
            key = (group, response.headers[HEADER_REPLICA])
            prefill_replicas.setdefault(key, set()).add(response.headers[HEADER_PREFILL_REPLICA])
    # Each decode replica routes its own prefills with the prefill pool's cache-aware router, on the prefill
    # engines' KV events: after a group's first prefill, its blocks are held on one prefill replica and the
    # rest of the group follows. The decode pool is routed least_loaded, so a group may reach the prefill pool
    # through both decode replicas; a router subscribes to the events at its first request, and misses those
    # published before it (docs/routing.md).
    assert all(len(replicas) == 1 for replicas in prefill_replicas.values()), prefill_replicas
    assert sum(len(replicas) for replicas in prefill_replicas.values()) >= 2  # some prefill routing happened


@pytest.mark.parametrize("how", ["stop_string", "client_disconnect"])
def test_early_end_frees_both_pools(pd_app, how):
    if how == "stop_string":
        text = completion(pd_app, max_tokens=12).json()["choices"][0]["text"]
        stopped = completion(pd_app, max_tokens=100, stop=[text[4:7]])
        assert stopped.status_code == 200 and stopped.json()["choices"][0]["finish_reason"] == "stop"
    else:
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{pd_app.base_url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for index, _ in enumerate(response.iter_lines()):
                if index >= 6:
                    break  # leaving the block closes the connection mid-decode
    gauges = wait_all_idle(pd_app)
    assert len(gauges) == 4 and all(g == {"running": 0.0, "waiting": 0.0, "kv": 0.0} for g in gauges.values())


def _burst(app: Served, num_requests: int, kill_after_s: float, victim: str) -> list[tuple[int, str]]:
    """Sends num_requests concurrent requests, kills ``victim`` after kill_after_s; (status, body) each."""

    async def one(index: int) -> tuple[int, str]:
        async with httpx.AsyncClient(timeout=90) as client:
            response = await client.post(f"{app.base_url}/v1/completions", json={
                "model": MODEL, "prompt": f"{index} {LONG_PROMPT}", "max_tokens": 32, "temperature": 0,
                "ignore_eos": True})
            return response.status_code, response.text

    async def run() -> list[tuple[int, str]]:
        tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
        await asyncio.sleep(kill_after_s)
        kill(victim)
        return await asyncio.gather(*tasks)

    return asyncio.run(run())


def test_killed_prefill_replica_is_retried_or_503_never_hangs(pd_app):
    victim = replica_actors("prefill")[0]
    started = time.monotonic()
    results = _burst(pd_app, num_requests=16, kill_after_s=0.3, victim=victim)
    elapsed = time.monotonic() - started
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 503}, results
    assert statuses.count(200) > 0
    for status, body in results:
        if status == 503:
            assert json.loads(body)["error"]["type"] == "service_unavailable"
    assert elapsed < 90  # every request answered (httpx would raise on its 90 s timeout)
    after = completion(pd_app)
    assert after.status_code == 200 and after.headers[HEADER_PREFILL_REPLICA]
    gauges = wait_all_idle(pd_app)
    decode = {key: g for key, g in gauges.items() if key[0] == "decode"}
    assert decode and all(g["running"] == 0 and g["kv"] == 0 for g in decode.values())


def test_killed_decode_replica_ends_streams_with_error_event(pd_app):
    landed: list[str] = []

    async def stream(index: int) -> tuple[str, list[dict]]:
        events = []
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{pd_app.base_url}/v1/completions", json={
                    "model": MODEL, "prompt": f"{index} {LONG_PROMPT}", "max_tokens": 450, "temperature": 0,
                    "stream": True, "ignore_eos": True}) as response:
                replica = response.headers.get(HEADER_REPLICA, f"HTTP {response.status_code}")
                landed.append(replica)
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
        return replica, events

    async def run() -> tuple[str, list]:
        tasks = [asyncio.create_task(stream(i)) for i in range(6)]
        while len(landed) < 6:
            await asyncio.sleep(0.05)
        # The decode replica holding the most streams dies while they are mid-decode.
        victim_id = max(set(landed), key=landed.count)
        names = [name for name in replica_actors("decode") if name.endswith(f"#{victim_id}")]
        assert names, f"streams landed on {landed}; decode replicas are {replica_actors('decode')}"
        kill(names[0])
        return victim_id, await asyncio.gather(*tasks)

    victim_id, results = asyncio.run(run())
    on_victim = [events for replica, events in results if replica == victim_id]
    assert on_victim
    for events in on_victim:
        # The stream ends with an error event, not silence, after some tokens (450 never arrive).
        assert "error" in events[-1] and events[-1]["error"]["type"] == "service_unavailable", events[-1]
        assert len(events) < 450
    # New requests go to the surviving decode replica.
    after = [completion(pd_app) for _ in range(3)]
    assert [r.status_code for r in after] == [200] * 3
    assert victim_id not in {r.headers[HEADER_REPLICA] for r in after}
