"""A tensor-parallel replica on CPU: vLLM's multiprocessing executor runs one worker per rank, each pinned to the
cores the platform split for it, and the sharded model answers as the same model on one rank does (SmolLM2 in
float32, greedy). SmolLM2 has 9 attention heads and 3 KV heads, so it shards 3 ways."""

from __future__ import annotations

import httpx
import pytest

from cluster_helpers import engine_core_pids
from conftest import SERVED_MODELS
from factories import model_entry
from fleetserve.platform.config import parse_config

pytestmark = pytest.mark.slow

MODEL = "smollm2-tp"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Return the number of items in a container. " * 8]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def sharded(served) -> str:
    from ray import serve

    from fleetserve.deployments.builders import build_app

    one_rank = next(entry for entry in SERVED_MODELS if entry["name"] == "smollm2")
    entry = {**one_rank, "name": MODEL, "engine_args": {**one_rank["engine_args"], "tensor_parallel_size": 3},
             "resources": {"num_cpus": 0.1, "cpu_binding": ["0-1"]}}
    serve.run(build_app(parse_config({"models": [entry]})), name="tp", route_prefix="/tp")
    yield f"{served.base_url}/tp"
    serve.delete("tp")


def greedy(base_url: str, model: str, prompt: str) -> dict:
    reply = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_three_ranks_answer_as_one_rank_does(served, sharded):
    for prompt in PROMPTS:
        three = greedy(sharded, MODEL, prompt)
        one = greedy(served.base_url, "smollm2", prompt)
        # vLLM names the parallel layout in the fingerprint: the replica really ran three ranks.
        assert "-tp3-" in three["system_fingerprint"] and "-tp" not in one["system_fingerprint"]
        assert three["choices"][0]["token_ids"] == one["choices"][0]["token_ids"]
        assert len(three["choices"][0]["token_ids"]) == MAX_TOKENS


def test_each_rank_runs_pinned_to_its_own_core(sharded):
    import psutil

    [core] = engine_core_pids(f"engine-{MODEL}").values()
    # The ranks are the engine core's spawned workers: by vLLM's title, or by the command line where a full-suite
    # run found them untitled (and no process named VLLM::Worker_TP* at all).
    workers = [child for child in psutil.Process(core).children()
               if child.name().startswith("VLLM::Worker_TP") or "multiprocessing.spawn" in " ".join(child.cmdline())]
    # "0-1" split between 3 ranks: fewer cores than ranks, so they take turns, "0|1|0".
    assert sorted(worker.cpu_affinity() for worker in workers) == [[0], [0], [1]]


def test_a_replica_that_cannot_start_says_why(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.deployments.local_run import AppStartError, run_application

    # The tiny model has 2 attention heads: vLLM refuses 3 ranks in the replica's constructor, and Serve itself
    # would report only "Failed to update the deployments".
    config = parse_config({"models": [{**model_entry("tiny-tp3", tensor_parallel_size=3),
                                       "resources": {"num_cpus": 0.1, "cpu_binding": ["0"]}}]})
    try:
        with pytest.raises(AppStartError, match=r"(?s)engine-tiny-tp3: .*divisible by tensor parallel size \(3\)"):
            run_application(build_app(config), "tp3", "/tp3")
    finally:
        serve.delete("tp3")
