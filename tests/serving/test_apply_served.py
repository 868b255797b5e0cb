"""`fleetserve apply` on a running app: a model added and another removed while a load runs against a
third; every request of the load succeeds, and the third model keeps its replica."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest
from factories import model_entry

from fleetserve.loadtest.datasets import PromptMaker, random_dataset
from fleetserve.loadtest.runner import BenchConfig, run_benchmark

pytestmark = pytest.mark.slow
KEEP, GONE, NEW = "tiny-keep", "tiny-gone", "tiny-new"
CORES = {KEEP: "0", GONE: "1", NEW: "1"}


def config(*names: str):
    from fleetserve.platform.config import parse_config

    return parse_config({"models": [{**model_entry(name), "resources": {"num_cpus": 0.1,
                                                                        "cpu_binding": [CORES[name]]}}
                                    for name in names]})


@pytest.fixture(scope="module")
def apply_app(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app

    serve.run(build_app(config(KEEP, GONE)), name="apply", route_prefix="/apply")
    yield f"{served.base_url}/apply"
    serve.delete("apply")


def test_apply_adds_and_removes_models_while_another_keeps_serving(apply_app):
    from fleetserve.deployments.apply import apply_config

    specs = random_dataset(160, input_len=32, output_len=8, range_ratio=0.0, prefix_len=0,
                           maker=PromptMaker(None, random.Random(0)))
    bench = BenchConfig(base_url=apply_app, model=KEEP, request_rate=4.0, seed=0, ignore_eos=True)
    results = []
    load = threading.Thread(target=lambda: results.append(asyncio.run(run_benchmark(bench, specs))))
    load.start()
    time.sleep(3)
    change = apply_config(config(KEEP, NEW), app_name="apply", route_prefix="/apply")
    applied_while_loading = load.is_alive()
    load.join(timeout=300)
    assert (change.added, change.removed, change.changed) == ([NEW], [GONE], {})
    assert applied_while_loading  # the load ran through the whole change
    [result] = results
    # 160 requests at 4/s: the load outlasts the change, and none of it fails (the ingress rolls under it).
    assert (result.metrics["completed"], result.metrics["failed"]) == (160, 0), result.to_dict(False)["errors"]
    assert len(result.to_dict(False)["routing"]["x-fleetserve-replica"]) == 1  # KEEP was not restarted
    names = {card["id"] for card in httpx.get(f"{apply_app}/v1/models", timeout=30).json()["data"]}
    assert names == {KEEP, NEW}
    body = {"prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{apply_app}/v1/completions", json={"model": NEW, **body}, timeout=60).status_code == 200
    gone = httpx.post(f"{apply_app}/v1/completions", json={"model": GONE, **body}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
