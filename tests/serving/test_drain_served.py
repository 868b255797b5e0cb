"""A stopping replica finishes the requests it holds (server.drain_timeout_s): deleting the app while an engine
that runs one sequence at a time holds a queue of generations lasting 30 s, past Serve's own 20 s default, every
one of them completes. With Serve's default, those still running or queued at 20 s were cut off. First, the same
app shows a model's env_vars reaching its engine."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from factories import model_entry

from fleetserve.platform.config import parse_config

pytestmark = pytest.mark.slow
APP = "drain"
MAX_TOKENS = 900
# How long the engine's queue should last once the app is being deleted: past Serve's default drain, 20 s.
QUEUE_S = 30
# Past the tiny model's max_position_embeddings (2048).
LONG_CONTEXT = 4096


@pytest.fixture(scope="module")
def drain_app(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app

    # One sequence at a time: the requests queue in the engine, and the last finishes one generation's time
    # per request after the deletion began. A context past the tiny model's 2048 positions, which vLLM serves only
    # with VLLM_ALLOW_LONG_MAX_MODEL_LEN set: the replica starts only if the model's env_vars reach its engine.
    entry = model_entry("tiny-drain", max_num_seqs=1, max_model_len=LONG_CONTEXT)
    config = parse_config({"models": [{**entry, "resources": {"num_cpus": 0.1, "cpu_binding": ["1"]},
                                       "env_vars": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}}],
                           "server": {"drain_timeout_s": 120}})
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield f"{served.base_url}/{APP}"
    if APP in serve.status().applications:
        serve.delete(APP)


def generate(url: str) -> dict:
    reply = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "tiny-drain", "prompt": "drain", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
    return {"status": reply.status_code, "body": reply.json() if reply.status_code == 200 else reply.text}


def test_a_models_env_vars_reach_its_engine(drain_app):
    # 2,100 prompt tokens: more than the model's 2048 positions, within the context the env var allowed.
    reply = httpx.post(f"{drain_app}/v1/completions", timeout=120, json={
        "model": "tiny-drain", "prompt": [5] * 2100, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 2100


def test_deleting_the_app_lets_every_admitted_generation_finish(drain_app):
    from ray import serve

    started = time.monotonic()
    assert generate(drain_app)["status"] == 200
    # Enough requests that the queue lasts QUEUE_S on this machine, whatever one generation takes here.
    num_requests = min(40, math.ceil(QUEUE_S / (time.monotonic() - started)) + 1)
    with ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(generate, drain_app) for _ in range(num_requests)]
        time.sleep(1.0)  # every request admitted and queued in the engine
        deleting = threading.Thread(target=serve.delete, args=(APP,))
        deleting.start()
        results = [future.result() for future in futures]
        deleting.join(timeout=300)
    assert [result["status"] for result in results] == [200] * num_requests, results
    for result in results:
        [choice] = result["body"]["choices"]
        assert (choice["finish_reason"], result["body"]["usage"]["completion_tokens"]) == ("length", MAX_TOKENS)
