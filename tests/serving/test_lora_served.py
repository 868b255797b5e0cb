"""LoRA adapters on two real replicas: output equals offline vLLM with the same LoRARequest, adapters stay
on their replica unless load is imbalanced, and adapters load and unload at run time on every replica."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster_helpers import engine_core_pids, kill, replica_actors, replica_logs, wait_until_healthy
from conftest import Served
from factories import model_entry, peft_folder

pytestmark = pytest.mark.slow

BASE = "tiny-lora"
# Configured adapters, and those loaded at run time by the tests.
CONFIGURED = {"tiny-a": "random-lora:1", "tiny-b": "random-lora:2"}
RUNTIME = {"tiny-c": "random-lora:3", "tiny-d": "random-lora:4"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "One, two, three, four,"]
CHATS = [[{"role": "user", "content": "Name three colours."}]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lora_app(served, tmp_path_factory):
    """The tiny model on 2 replicas (one per core) with two adapters, and an adapter root whose folder `c` holds
    tiny-c's weights. Each engine holds one adapter at a time (max_cpu_loras 1), so where an adapter's requests
    go decides how often engines reload it. An engine that holds requests 20 s without a step counts as hung
    (its steps here take milliseconds)."""
    import shutil

    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import parse_config
    from fleetserve.platform.lora_store import random_lora
    from fleetserve.platform.model_store import resolve_source

    root = tmp_path_factory.mktemp("adapter-root")
    seed = int(RUNTIME["tiny-c"].removeprefix("random-lora:"))
    shutil.copytree(random_lora(Path(resolve_source("tiny-random-llama")), seed), root / "c")
    config = parse_config({"models": [{
        **model_entry(BASE), "replicas": 2, "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]},
        "stall_timeout_s": 20,
        "lora": {"adapters": [{"name": n, "source": s} for n, s in CONFIGURED.items()], "adapter_root": str(root),
                 "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 8},
        "routing": {"policy": "cache_aware", "balance_abs_threshold": 2, "balance_rel_threshold": 1.5}}]})
    serve.run(build_app(config), name="lora", route_prefix="/lora")
    yield Served(base_url=f"{served.base_url}/lora", config=config, handles={})
    serve.delete("lora")


@pytest.fixture(scope="module")
def reference(lora_app):
    """Greedy outputs of the base and of every adapter from vLLM's offline LLM with a LoRARequest."""
    script = Path(__file__).with_name("offline_reference.py")
    cases = json.dumps({"completions": PROMPTS, "chats": CHATS, "max_tokens": MAX_TOKENS, "adapters": {BASE: RUNTIME}})
    models = json.dumps([model.model_dump(mode="json") for model in lora_app.config.models])
    done = subprocess.run([sys.executable, str(script), models, cases], capture_output=True, text=True, timeout=900)
    line = [line for line in done.stdout.splitlines() if line.startswith("REFERENCE ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    return json.loads(line[0][len("REFERENCE "):])


def served_outputs(url: str, name: str) -> dict[str, list[str]]:
    with httpx.Client(timeout=120) as http:
        completions = [http.post(f"{url}/completions", json={"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                             "temperature": 0}).json()["choices"][0]["text"]
                       for prompt in PROMPTS]
        chats = [http.post(f"{url}/chat/completions", json={"model": name, "messages": messages,
                                                            "max_tokens": MAX_TOKENS, "temperature": 0}
                           ).json()["choices"][0]["message"]["content"] for messages in CHATS]
    return {"completions": completions, "chats": chats}


def test_adapters_list_with_their_base_as_parent(lora_app):
    cards = httpx.get(f"{lora_app.api_url}/models", timeout=30).json()["data"]
    # The configured adapters, and the adapter root's one folder (as Ray Serve LLM lists a dynamic LoRA path).
    assert {card["id"]: card.get("parent") for card in cards} == {BASE: None, "tiny-a": BASE, "tiny-b": BASE,
                                                                  f"{BASE}:c": BASE}


def test_adapter_output_equals_offline_vllm_and_differs_from_the_base(lora_app, reference):
    outputs = {name: served_outputs(lora_app.api_url, name) for name in (BASE, *CONFIGURED)}
    for name, output in outputs.items():
        assert output == reference[name], name
    # Random non-zero adapters change every greedy completion.
    for name in CONFIGURED:
        assert all(a != b for a, b in zip(outputs[name]["completions"], outputs[BASE]["completions"])), name


def test_each_adapter_stays_on_one_replica_and_the_two_spread(lora_app):
    placements: dict[str, set[str]] = {"tiny-a": set(), "tiny-b": set()}
    reasons = []
    with httpx.Client(timeout=120) as http:
        for i in range(12):
            name = "tiny-a" if i % 2 == 0 else "tiny-b"
            # Distinct prompts, sequential: no prefix hit and no imbalance, so only adapter affinity decides.
            response = http.post(f"{lora_app.api_url}/completions",
                                 json={"model": name, "prompt": f"request number {i} of twelve", "max_tokens": 2})
            assert response.status_code == 200, response.text
            placements[name].add(response.headers["x-fleetserve-replica"])
            reasons.append(response.headers["x-fleetserve-route-reason"])
    assert all(len(replicas) == 1 for replicas in placements.values()), placements
    assert placements["tiny-a"] != placements["tiny-b"]
    # Each adapter's first request goes by load, or home if an earlier test sent that adapter here; every
    # later one goes home.
    assert set(reasons[:2]) <= {"load", "adapter"} and reasons[2:] == ["adapter"] * 10


def test_a_burst_for_one_adapter_spreads_once_load_is_imbalanced(lora_app):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(f"{lora_app.api_url}/completions", json={
                "model": "tiny-a", "prompt": f"burst {i}", "max_tokens": 48, "ignore_eos": True}) for i in range(8)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8
    # Past 2 outstanding more on one replica than the other (balance_abs_threshold), the other takes requests.
    assert len({r.headers["x-fleetserve-replica"] for r in responses}) == 2
    assert "imbalance" in [r.headers["x-fleetserve-route-reason"] for r in responses]


def change(url: str, op: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{op}_lora_adapter", json=body, timeout=120)


def test_adapter_loaded_at_run_time_serves_on_both_replicas_then_unloads(lora_app, reference, tmp_path):
    loaded = change(lora_app.base_url, "load", {"lora_name": "tiny-c", "lora_path": RUNTIME["tiny-c"]})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'tiny-c' added successfully.")
    assert loaded.headers["x-fleetserve-adapter-replicas"] == "2/2"
    assert served_outputs(lora_app.api_url, "tiny-c") == reference["tiny-c"]
    again = change(lora_app.base_url, "load", {"lora_name": "tiny-c", "lora_path": RUNTIME["tiny-c"]})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    unloaded = change(lora_app.base_url, "unload", {"lora_name": "tiny-c"})
    assert (unloaded.status_code, unloaded.headers["x-fleetserve-adapter-replicas"]) == (200, "2/2")
    gone = httpx.post(f"{lora_app.api_url}/completions", json={"model": "tiny-c", "prompt": "a", "max_tokens": 1},
                      timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    missing = change(lora_app.base_url, "load", {"lora_name": "tiny-x", "lora_path": "/no/such/adapter"})
    assert missing.status_code == 404 and "not found" in missing.json()["error"]["message"]
    malformed = change(lora_app.base_url, "load", {"lora_name": "tiny-x", "lora_path": "random-lora:abc"})
    assert (malformed.status_code, malformed.json()["error"]["type"]) == (400, "BadRequestError")
    # vLLM answers a 500 for this once its engine has tried the adapter.
    too_big = change(lora_app.base_url, "load", {"lora_name": "tiny-x", "lora_path": str(peft_folder(tmp_path, r=16))})
    assert (too_big.status_code, too_big.json()["error"]["param"]) == (400, "lora_path")
    assert too_big.json()["error"]["message"].endswith("LoRA rank 16 is greater than max_lora_rank 8.")
    names = {card["id"] for card in httpx.get(f"{lora_app.api_url}/models", timeout=30).json()["data"]}
    assert names == {BASE, *CONFIGURED, f"{BASE}:c"}  # the adapter root's folder is listed from the root


def test_a_replica_started_later_serves_the_current_adapter_set(lora_app, reference):
    from ray import serve

    from fleetserve.deployments.metrics_hub import HUB_DEPLOYMENT, REPLICA_TTL_S
    from fleetserve.deployments.serve_options import deployment_name

    loaded = change(lora_app.base_url, "load", {"lora_name": "tiny-d", "lora_path": RUNTIME["tiny-d"]})
    assert loaded.headers["x-fleetserve-adapter-replicas"] == "2/2"
    deployment = deployment_name(lora_app.config.models[0])
    victim = replica_actors(deployment)[0]
    kill(victim)
    killed_at = time.monotonic()
    deadline = killed_at + 240
    while time.monotonic() < deadline and (victim in replica_actors(deployment)
                                           or len(replica_actors(deployment)) < 2):
        time.sleep(1)
    assert wait_until_healthy("lora") < float("inf")
    hub = serve.get_deployment_handle(HUB_DEPLOYMENT, "lora")
    version = hub.adapter_set.remote(BASE).result().version
    progress = None
    while time.monotonic() < deadline:
        progress = hub.adapter_progress.remote(BASE, version).result()
        # Until the victim's last push expires, the hub still counts it (serving tiny-d) as live.
        if progress == (2, 2) and time.monotonic() - killed_at > REPLICA_TTL_S:
            break
        time.sleep(1)
    # The new replica synced to the set with tiny-d before its first request, and says so at its push.
    assert progress == (2, 2)
    assert served_outputs(lora_app.api_url, "tiny-d") == reference["tiny-d"]


def burst(api_url: str, timeout_s: float) -> list[httpx.Response]:
    """12 distinct completions at once: more than the balance threshold, so the router spreads them over both
    replicas."""
    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return await asyncio.gather(*(client.post(f"{api_url}/completions", json={
                "model": BASE, "prompt": f"{index} {PROMPTS[index % len(PROMPTS)]}", "max_tokens": 8})
                for index in range(12)))

    return asyncio.run(send())


def stream_through_engine_death(api_url: str, engine_pids: dict[str, int]) -> list:
    """A 900-token stream whose replica's engine core is killed (SIGKILL, its replica lives on) once the first
    event has arrived; every event it then got, parsed ("[DONE]" as is)."""
    import os
    import signal

    events = []
    with httpx.stream("POST", f"{api_url}/completions", timeout=120, json={
            "model": BASE, "prompt": "a long story", "max_tokens": 900, "ignore_eos": True, "stream": True}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if len(events) == 1:
                os.kill(engine_pids[stream.headers["x-fleetserve-replica"]], signal.SIGKILL)
    return events


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_replica_whose_engine_fails_is_replaced_and_every_request_served(lora_app, fault):
    import os
    import signal

    from fleetserve.deployments.serve_options import deployment_name

    deployment = deployment_name(lora_app.config.models[0])
    assert wait_until_healthy("lora") < float("inf")
    before = replica_actors(deployment)
    engine_pids = engine_core_pids(deployment)
    assert len(before) == len(engine_pids) == 2
    if fault == "dies":
        events = stream_through_engine_death(lora_app.api_url, engine_pids)
        # The stream its engine died under ends as a replica's death mid-stream does (before: vLLM's
        # InternalServerError "See stack trace (above) for the root cause").
        assert events[-2]["error"]["code"] == "engine_unavailable" and events[-1] == "[DONE]"
        assert "the model's engine died during the response" in events[-2]["error"]["message"]
        assert all("choices" in event for event in events[:-2]) and len(events) < 2 + 900
        time.sleep(0.5)  # vLLM's monitor marks the engine dead when its process goes
        responses = burst(lora_app.api_url, timeout_s=60)
        # Each request the dead replica got was refused before any output and sent to the live one (before,
        # each was a 500 "'State' object has no attribute 'server'" until Serve replaced the replica).
        assert len({response.headers["x-fleetserve-replica"] for response in responses}) == 1
    else:
        hung = next(iter(engine_pids.values()))
        os.kill(hung, signal.SIGSTOP)  # hung: neither dead nor erring, so vLLM's health check passes
        try:
            # Those the hung engine held wait until its replica fails its health check (a 20 s stall, then
            # Serve's 3 failed checks 10 s apart) and is stopped; with no output yet, each is sent again. Before,
            # they waited for their 300 s progress timeout, past this client's 280 s.
            responses = burst(lora_app.api_url, timeout_s=280)
        finally:
            if os.path.exists(f"/proc/{hung}"):
                os.kill(hung, signal.SIGKILL)
    assert [response.status_code for response in responses] == [200] * 12, [r.text for r in responses]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (set(replica_actors(deployment)) >= set(before)
                                           or len(replica_actors(deployment)) < 2):
        time.sleep(1)
    # Serve's health check replaced the failed replica.
    assert len(set(before) - set(replica_actors(deployment))) == 1 and wait_until_healthy("lora") < float("inf")


def test_apply_changes_configured_adapters_in_place_and_keeps_those_loaded_at_run_time(lora_app, reference):
    from fleetserve.deployments.apply import apply_config
    from fleetserve.deployments.serve_options import deployment_name
    from fleetserve.platform.config import parse_config

    assert wait_until_healthy("lora") < float("inf")
    # tiny-e, the same weights as tiny-d, loaded through the admin API: the config never names it.
    loaded = change(lora_app.base_url, "load", {"lora_name": "tiny-e", "lora_path": RUNTIME["tiny-d"]})
    assert loaded.headers["x-fleetserve-adapter-replicas"] == "2/2"
    deployment = deployment_name(lora_app.config.models[0])
    before = replica_actors(deployment)
    listed = {card["id"] for card in httpx.get(f"{lora_app.api_url}/models", timeout=30).json()["data"]}
    assert {"tiny-a", "tiny-b", "tiny-e"} <= listed and "tiny-c" not in listed  # (earlier tests loaded tiny-d)
    entry = lora_app.config.models[0].model_dump(mode="json")
    entry["lora"]["adapters"] = [{"name": "tiny-a", "source": CONFIGURED["tiny-a"]},
                                 {"name": "tiny-c", "source": RUNTIME["tiny-c"]}]
    applied = apply_config(parse_config({"models": [entry]}), app_name="lora", route_prefix="/lora")
    # Before, any adapter change restarted every replica (48 s on 2 tiny replicas) and lost tiny-e.
    assert applied.changed == {BASE: ["lora.adapters"]} and not applied.restarts(BASE)
    assert replica_actors(deployment) == before
    cards = httpx.get(f"{lora_app.api_url}/models", timeout=30).json()["data"]
    # The config dropped tiny-b and added tiny-c; every adapter loaded at run time stayed.
    assert {card["id"] for card in cards} == listed - {"tiny-b"} | {"tiny-c"}
    assert {card.get("parent") for card in cards if card["id"] != BASE} == {BASE}
    # apply returned once both replicas served the new set: tiny-c answers at once, tiny-b is gone.
    assert served_outputs(lora_app.api_url, "tiny-c") == reference["tiny-c"]
    assert served_outputs(lora_app.api_url, "tiny-e") == reference["tiny-d"]
    dropped = httpx.post(f"{lora_app.api_url}/completions", json={"model": "tiny-b", "prompt": "a", "max_tokens": 1},
                         timeout=60)
    assert dropped.status_code == 404 and dropped.json()["error"]["code"] == "model_not_found"


def test_an_adapter_under_the_root_serves_on_its_first_request(lora_app, reference):
    name = f"{BASE}:c"
    # Each replica that gets a request for it loads it first; tiny-c's weights give tiny-c's output.
    assert served_outputs(lora_app.api_url, name) == reference["tiny-c"]
    missing = httpx.post(f"{lora_app.api_url}/completions", json={"model": f"{BASE}:nope", "prompt": "a",
                                                                  "max_tokens": 1}, timeout=60)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    assert missing.json()["error"]["message"].startswith(f"The model `{BASE}:nope` does not exist")
    # No registry holds them (/v1/models lists the root's folders, not what replicas loaded): the admin API's
    # set, and the replicas' next syncs, leave them be.
    listed = {card["id"] for card in httpx.get(f"{lora_app.api_url}/models", timeout=30).json()["data"]}
    assert name in listed and f"{BASE}:nope" not in listed
    time.sleep(2)  # past a registry push (1 s)
    assert served_outputs(lora_app.api_url, name) == reference["tiny-c"]


def mismatched_adapter(path: Path) -> Path:
    """A copy of a random adapter for the tiny model whose lora_B matrices have 3 rows too many: its config
    passes every check, and only vLLM's engine finds that it does not fit the base."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from fleetserve.platform.lora_store import random_lora
    from fleetserve.platform.model_store import resolve_source

    shutil.copytree(random_lora(Path(resolve_source("tiny-random-llama")), 1), path)
    weights = load_file(path / "adapter_model.safetensors")
    save_file({name: torch.zeros(tensor.shape[0] + 3, tensor.shape[1]) if "lora_B" in name else tensor
               for name, tensor in weights.items()}, path / "adapter_model.safetensors")
    return path


def test_a_configured_adapter_the_engine_refuses_stops_the_replica_starting_with_its_reason(served, tmp_path):
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.deployments.local_run import AppStartError, run_application
    from fleetserve.platform.config import parse_config

    config = parse_config({"models": [{
        **model_entry("tiny-misfit"), "resources": {"num_cpus": 0.1, "cpu_binding": ["0"]},
        "lora": {"adapters": [{"name": "tiny-misfit-a", "source": str(mismatched_adapter(tmp_path / "a"))}],
                 "max_lora_rank": 8}, "max_start_failures": 1}]})
    # Before, the replica started healthy and answered every request, the base model's included, with a 500.
    try:
        with pytest.raises(AppStartError, match=r"(?s)engine-tiny-misfit: .*models\[tiny-misfit\]: vLLM's OpenAI "
                                                r"app did not build: .*size of tensor a \(128\) must match"):
            run_application(build_app(config), "misfit", "/misfit")
    finally:
        serve.delete("misfit")
    # One start, as max_start_failures says (Serve's default starts it 3 times): each start logs to a file of its own.
    assert len(replica_logs("misfit", "engine-tiny-misfit")) == 1
