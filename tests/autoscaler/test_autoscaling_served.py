"""The KV-cache policy driving a real Serve deployment of the tiny model, loaded with `fleetserve bench`."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
import cluster_helpers
from cluster_helpers import wait_for
from factories import model_entry

pytestmark = pytest.mark.slow
MiB = 1024 * 1024
MODEL = "tiny-autoscale"


@pytest.fixture(scope="module")
def autoscaled(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import parse_config

    # A small KV pool (8 MiB) and few sequences per replica, so a modest load fills one replica.
    entry = model_entry(MODEL, kv_cache_memory_bytes=8 * MiB, max_num_seqs=8)
    config = parse_config({"models": [{**entry, "resources": {"num_cpus": 0.1, "cpu_binding": ["1", "0"]},
                                       "autoscaling": {
                                           "policy": "kv_cache", "min_replicas": 1, "max_replicas": 2,
                                           "target_high": 0.6, "target_low": 0.2, "max_waiting_per_replica": 2,
                                           "window_s": 3, "scale_down_cooldown_s": 5, "downscale_stabilization_s": 0,
                                           "decision_period_s": 0.5, "metrics_interval_s": 0.5}}]})
    serve.run(build_app(config), name="autoscale", route_prefix="/autoscale")
    yield f"{served.base_url}/autoscale"
    serve.delete("autoscale")


def running_replicas() -> int:
    return cluster_helpers.running_replicas("autoscale", f"engine-{MODEL}")



def decisions(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf'fleetserve_autoscaler_decisions_total{{model="{MODEL}",pool="colocated",reason="(\w+)"}} ([0-9.e+]+)'
    return {reason: float(value) for reason, value in re.findall(pattern, text)}


def desired(url: str) -> float | None:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf'fleetserve_autoscaler_desired_replicas{{model="{MODEL}",pool="colocated"}} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else None


def test_bench_load_scales_up_and_idle_scales_back_down(autoscaled, tmp_path):
    assert running_replicas() == 1
    # 16 concurrent streams of 64 + 512 tokens: twice the 8 sequences one replica runs, so requests
    # wait; long outputs keep the load up with few requests.
    load = subprocess.Popen(
        [sys.executable, "-m", "fleetserve.cli", "bench", "--base-url", autoscaled, "--model", MODEL,
         "--num-prompts", "200", "--request-rate", "inf", "--max-concurrency", "16", "--random-input-len", "64",
         "--random-output-len", "512", "--ignore-eos", "--tokenizer", "tiny-random-llama",
         "--max-seconds", "300", "--save-result", str(tmp_path / "load.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: desired(autoscaled) == 2.0, 240, "the policy to ask for a second replica under load")
        up = decisions(autoscaled)
        # The decision that added the replica names its trigger (the queue here; KV or TTFT would do).
        assert up.get("queue", 0) + up.get("kv_high", 0) + up.get("ttft", 0) > 0, up
    finally:
        # The load has done its part: the policy never shrinks while a replica starts, and the new
        # engine starts sooner on idle cores (on these 2 cores, minutes under load).
        load.terminate()
        load.wait(timeout=60)
    wait_for(lambda: running_replicas() == 2, 300, "the second replica to start")
    # Idle: KV usage falls below target_low; after the 5 s cooldown one replica goes.
    wait_for(lambda: running_replicas() == 1, 120, "scale-down to min_replicas")
    down = decisions(autoscaled)
    assert down.get("kv_low", 0) >= 1, down
    assert desired(autoscaled) == 1.0
    # Still serving after the cycle.
    response = httpx.post(f"{autoscaled}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200
