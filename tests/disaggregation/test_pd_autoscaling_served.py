"""A disaggregated model's pools scaled apart on a real Serve deployment: long outputs grow the decode pool
while the prefill pool, with little prompt work, stays at one replica."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest

from cluster_helpers import wait_until_healthy
from factories import model_entry

pytestmark = [pytest.mark.slow]
pytest.importorskip("nixl", reason="disaggregation needs nixl (make install adds it)")

MODEL = "pd-autoscale"


@pytest.fixture(scope="module")
def pd_autoscaled(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import parse_config

    def pool(**knobs) -> dict:
        return {"replicas": 1, "cpu_binding": ["1", "0"], "autoscaling": {
            "policy": "kv_cache", "min_replicas": 1, "max_replicas": 2, "window_s": 3, "scale_down_cooldown_s": 5,
            "downscale_stabilization_s": 0, "decision_period_s": 0.5, "metrics_interval_s": 0.5, **knobs}}

    # Decode runs 2 sequences per replica, so 8 long streams leave 6 waiting: its queue rule (1 per replica)
    # asks for a second replica. Prefill sees 16-token prompts: no prompt work to scale on, and its queue and
    # TTFT rules are set past what a burst of 8 short prompts reaches.
    config = parse_config({"models": [{
        **model_entry(MODEL), "resources": {"num_cpus": 0.1},
        "disaggregation": {"prefill": pool(max_waiting_per_replica=16, ttft_target_s=30),
                           "decode": {**pool(max_waiting_per_replica=1), "engine_args": {"max_num_seqs": 2}}}}]})
    serve.run(build_app(config), name="pd-autoscale", route_prefix="/pd-autoscale")
    yield f"{served.base_url}/pd-autoscale"
    wait_until_healthy("pd-autoscale")
    serve.delete("pd-autoscale")


def running(deployment: str) -> int:
    from ray import serve

    return serve.status().applications["pd-autoscale"].deployments[deployment].replica_states.get("RUNNING", 0)


def autoscaler_metrics(url: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """Desired replicas by pool, and decision counts by (pool, reason), from the platform's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    desired = {pool: float(value) for pool, value in re.findall(
        rf'fleetserve_autoscaler_desired_replicas{{model="{MODEL}",pool="(\w+)"}} ([0-9.e+]+)', text)}
    decisions = {(pool, reason): float(value) for pool, reason, value in re.findall(
        rf'fleetserve_autoscaler_decisions_total{{model="{MODEL}",pool="(\w+)",reason="(\w+)"}} ([0-9.e+]+)', text)}
    return desired, decisions


def test_long_outputs_scale_the_decode_pool_and_not_the_prefill_pool(pd_autoscaled, tmp_path):
    assert (running(f"prefill-{MODEL}"), running(f"engine-{MODEL}")) == (1, 1)
    load = subprocess.Popen(
        [sys.executable, "-m", "fleetserve.cli", "bench", "--base-url", pd_autoscaled, "--model", MODEL,
         "--num-prompts", "64", "--max-concurrency", "8", "--random-input-len", "16", "--random-output-len", "400",
         "--ignore-eos", "--tokenizer", "tiny-random-llama", "--max-seconds", "300"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prefill_desired: list[float] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            desired, _ = autoscaler_metrics(pd_autoscaled)
            prefill_desired.append(desired.get("prefill", 1.0))
            if desired.get("decode") == 2.0:
                break
            time.sleep(1)
        desired, decisions = autoscaler_metrics(pd_autoscaled)
        assert desired.get("decode") == 2.0, f"the decode pool never asked for a second replica: {decisions}"
        assert decisions.get(("decode", "queue"), 0) >= 1, decisions
        # The prefill pool's policy ran all along and never asked for more than its one replica.
        assert set(prefill_desired) == {1.0} and desired.get("prefill") == 1.0
        assert not {reason for pool, reason in decisions if pool == "prefill"} & {"queue", "ttft", "kv_high",
                                                                                   "prefill_high"}, decisions
    finally:
        load.terminate()
        load.wait(timeout=60)
    deadline = time.monotonic() + 300
    while running(f"engine-{MODEL}") < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert (running(f"prefill-{MODEL}"), running(f"engine-{MODEL}")) == (1, 2)
