"""The platform on a 3-node Ray cluster on this machine: placement by slice, prefill and decode pools on two
nodes, a refused unplaceable model, and a node lost under load.

Started as a user would: ``ray start --head``, ``ray start --address`` for two worker nodes offering MIG-style
custom resources, then ``fleetserve serve --address``. One host stands for several, so this says nothing of
network partitions, cross-host latency or RDMA (docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from cluster_helpers import metric_values, send_workload, wait_all_idle
from conftest import SERVED_MODELS
from factories import model_entry
from fleetserve.deployments.ingress.protocol import HEADER_PREFILL_REPLICA
from fleetserve.deployments.metrics_hub import HUB_DEPLOYMENT
from fleetserve.loadtest.datasets import RequestSpec
from fleetserve.loadtest.local_server import free_port
from fleetserve.loadtest.runner import BenchConfig, run_benchmark
from local_cluster import LocalCluster, clean_env

pytestmark = [pytest.mark.slow]
pytest.importorskip("nixl", reason="disaggregation needs nixl (make install adds it)")

SMALL, PREFILL, DECODE, MISSING = "mig-1g.18gb", "mig-2g.35gb", "mig-3g.71gb", "mig-7g.141gb"
# head: the ingress and the metrics hub (server.custom_resources asks for the head's own resource); a and b:
# one small slice each, plus a's 2g and b's 3g slice. `small` (2 replicas of a small slice) then needs both
# nodes, and the disaggregated `pd` prefills on a and decodes on b.
WORKERS = {"a": {SMALL: 1, PREFILL: 1}, "b": {SMALL: 1, DECODE: 1}}
PLACED = {("small", "colocated"): ["a", "b"], ("pd", "prefill"): ["a"], ("pd", "decode"): ["b"]}
NUM_LOAD_REQUESTS = 120
# The suite's shared SmolLM2 (float32, the same engine args), served colocated on the suite's own cluster, is
# the reference for its disaggregated copy here.
SMOLLM2 = next(entry for entry in SERVED_MODELS if entry["name"] == "smollm2")
PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           " ".join(f"Item {i}: a box of {i % 7} red apples." for i in range(40))]


def small_on(slice_name: str, replicas: int, name: str = "small") -> dict:
    # Routed on the engines' own KV events: the router subscribes to each replica's node.
    return {**model_entry(name, max_num_seqs=16), "replicas": replicas,
            "resources": {"num_cpus": 0.1, "custom_resources": {slice_name: 1}},
            "routing": {"policy": "cache_aware", "prefix_source": "kv_events"}}


def disaggregated_smollm2() -> dict:
    return {**SMOLLM2, "name": "pd", "resources": {"num_cpus": 0.1}, "disaggregation": {
        "prefill": {"custom_resources": {PREFILL: 1}}, "decode": {"custom_resources": {DECODE: 1}}}}


def platform_config(port: int, *models: dict) -> dict:
    # Everything the client talks to stays on the head: the ingress, the hub and Serve's proxy.
    return {"server": {"port": port, "custom_resources": {"node:__internal_head__": 0.001},
                       "proxy_location": "HeadOnly"}, "models": list(models)}


def fleetserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # A terminal wide enough for status's ten columns (rich fits tables to COLUMNS when not on a tty).
    return subprocess.run([sys.executable, "-m", "fleetserve.cli", *args], capture_output=True, text=True,
                          env={**clean_env(), "COLUMNS": "200"}, timeout=timeout)


class Platform:
    """`fleetserve serve --address` on the local cluster."""

    def __init__(self, cluster: LocalCluster, config_path: Path, port: int) -> None:
        self.cluster, self.config_path = cluster, config_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = cluster.temp_dir / "serve.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fleetserve.cli", "serve", str(config_path), "--address", cluster.address],
            stdout=subprocess.PIPE, stderr=self.log_path.open("w"), text=True, env=clean_env())

    def wait_ready(self) -> None:
        ready = self.process.stdout.readline()  # READY only once every deployment runs
        assert ready.strip() == f"READY {self.base_url}/v1", self.log_path.read_text()[-3000:]

    def replica_nodes(self) -> dict[tuple[str, str], list[str]]:
        """(model, pool) -> the names of the nodes its engine replicas report, sorted."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        nodes: dict[tuple[str, str], list[str]] = {}
        for labels, _ in metric_values(text, "fleetserve_replica_node_info"):
            nodes.setdefault((labels["model_name"], labels["pool"]), []).append(
                self.cluster.name_of(labels["node_id"]))
        return {key: sorted(names) for key, names in nodes.items()}

    def wait_placed(self, expected: dict[tuple[str, str], list[str]], timeout_s: float) -> dict:
        """The replicas' nodes once they are ``expected`` (a replica reports within a publish period; a dead
        one leaves the hub's view once its reports go stale), or as last seen at the timeout."""
        deadline = time.monotonic() + timeout_s
        while (nodes := self.replica_nodes()) != expected and time.monotonic() < deadline:
            time.sleep(1)
        return nodes

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="module")
def cluster():
    cluster = LocalCluster()
    try:
        cluster.start_node("head", head=True)
        for name, resources in WORKERS.items():
            cluster.start_node(name, resources)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def platform(cluster, tmp_path_factory):
    port = free_port()
    config_path = tmp_path_factory.mktemp("multinode") / "platform.yaml"
    config_path.write_text(yaml.safe_dump(platform_config(port, small_on(SMALL, replicas=2), disaggregated_smollm2())))
    served = Platform(cluster, config_path, port)
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


def with_huge_model(config: dict, tmp_path: Path) -> Path:
    """The config plus a model asking for a slice no node offers, written to a file."""
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump({**config, "models": [*config["models"], small_on(MISSING, 1, name="huge")]}))
    return path


HUGE_REFUSED = f"model 'huge': one replica asks for {{CPU: 0.1, {MISSING}: 1}}, and no node offers '{MISSING}'"


async def complete_all(base_url: str, model: str, prompts: list[str]) -> list[httpx.Response]:
    """Sends every prompt at once (4 tokens each); the responses in order."""
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(f"{base_url}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 4}) for prompt in prompts))


def complete(base_url: str, model: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4},
                      timeout=60)


def retry_until(attempt, done, timeout_s: float):
    """Calls ``attempt`` every second until ``done`` holds for its result or ``timeout_s`` passes; the last
    result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = attempt()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(1)


def spread_over(base_url: str, model: str, timeout_s: float) -> set[str]:
    """Sends 16 new prompts at once until they land on more than one replica, or the timeout; the replicas
    that answered the last 16 (each of which must be a 200)."""
    rounds = itertools.count()

    def attempt() -> set[str]:
        round_id = next(rounds)
        prompts = [f"fresh {round_id}.{i}: " + " ".join(f"v{(7 * i + j + round_id) % 97}" for j in range(48))
                   for i in range(16)]
        answers = asyncio.run(complete_all(base_url, model, prompts))
        assert [answer.status_code for answer in answers] == [200] * 16, [answer.text for answer in answers]
        return {answer.headers["x-fleetserve-replica"] for answer in answers}

    return retry_until(attempt, lambda replicas: len(replicas) > 1, timeout_s)


def complete_prefilled_remotely(base_url: str, model: str, timeout_s: float) -> httpx.Response:
    """The first answer that names a prefill replica, an error, or the last local answer at the timeout."""
    return retry_until(lambda: complete(base_url, model),
                       lambda answer: answer.status_code != 200 or HEADER_PREFILL_REPLICA in answer.headers,
                       timeout_s)


def test_serve_refuses_a_model_no_node_can_host_naming_the_slice(cluster, tmp_path):
    # Before anything is deployed (the platform fixture starts after this test): the check runs first.
    huge = with_huge_model(platform_config(free_port(), small_on(SMALL, replicas=2)), tmp_path)
    served = fleetserve("serve", str(huge), "--address", cluster.address)
    assert served.returncode == 2 and HUGE_REFUSED in " ".join(served.stderr.split()), served.stderr


def test_replicas_run_only_on_nodes_offering_their_slice(platform):
    # small's two replicas need a's and b's single small slices; pd's pools, a's 2g and b's 3g; none runs on
    # the head.
    assert platform.wait_placed(PLACED, timeout_s=30) == PLACED
    assert complete(platform.base_url, "small").json()["usage"]["completion_tokens"] == 4
    status = fleetserve("status", "--once", "--url", platform.base_url)
    assert status.returncode == 0, status.stderr
    for name in ("a", "b"):
        assert platform.cluster.nodes[name].node_id[:8] in status.stdout
    # serve said that the cores it planned for the engines without cpu_binding are this machine's, not the nodes'.
    log = " ".join(platform.log_path.read_text().split())
    assert ("warning: small, pd (prefill), pd (decode): CPU engines without resources.cpu_binding are pinned as "
            "if all ran on this machine") in log, log


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chat-like", "long"])
def test_prefill_on_one_node_and_decode_on_another_equal_colocated_output(platform, served, prompt):
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    pd = httpx.post(f"{platform.base_url}/v1/completions", json={"model": "pd", **body}, timeout=120)
    reference = httpx.post(f"{served.api_url}/completions", json={"model": "smollm2", **body}, timeout=120)
    assert pd.status_code == 200, pd.text
    # Prefilled by a's replica and decoded by b's, from the KV that NIXL moved between the two nodes' engines.
    assert pd.headers["x-fleetserve-pool"] == "decode" and pd.headers[HEADER_PREFILL_REPLICA]
    assert pd.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_kv_event_routing_follows_replicas_on_both_nodes(platform):
    groups, reasons, hit_rate = send_workload(f"{platform.base_url}/v1", "small")
    # As with the routed index on one node (tests/router/test_routing_e2e.py): each group stays on one replica,
    # both replicas (one per node) are used, 8 first requests go by load and 24 by the cache that each node's
    # engine reported. The suite's only end-to-end test of kv_events routing.
    assert all(len(replicas) == 1 for replicas in groups.values())
    assert len(set().union(*groups.values())) == 2
    assert reasons.count("cache_hit") == 24 and reasons.count("load") == 8
    assert hit_rate > 0.6, hit_rate


def test_apply_refuses_a_model_no_node_can_host_naming_the_slice(platform, tmp_path):
    huge = with_huge_model(yaml.safe_load(platform.config_path.read_text()), tmp_path)
    applied = fleetserve("apply", str(huge), "--address", platform.cluster.address)
    assert applied.returncode == 2 and HUGE_REFUSED in " ".join(applied.stderr.split()), applied.stderr
    # A second `serve` on a cluster already serving the platform is refused too: it would replace it.
    served = fleetserve("serve", str(huge), "--address", platform.cluster.address)
    assert served.returncode == 1 and "already serves the platform" in served.stderr, served.stderr
    # Neither touched the running platform.
    assert platform.replica_nodes() == PLACED


def test_apply_on_the_joined_cluster_keeps_every_engine_replica(platform, tmp_path):
    def engine_replicas() -> list[str]:
        return [name for name in platform.cluster.serve_replicas()
                if "#ingress#" not in name and f"#{HUB_DEPLOYMENT}#" not in name]

    engines = engine_replicas()
    # small's two replicas, pd's prefill and decode replica.
    assert len(engines) == 4, engines
    config = yaml.safe_load(platform.config_path.read_text())
    config["server"]["cors"] = {"allowed_origins": ["https://chat.example.com"]}
    path = tmp_path / "cors.yaml"
    path.write_text(yaml.safe_dump(config))
    applied = fleetserve("apply", str(path), "--address", platform.cluster.address, timeout=300)
    assert applied.returncode == 0, applied.stderr
    preflight = httpx.options(f"{platform.base_url}/v1/completions", timeout=30, headers={
        "Origin": "https://chat.example.com", "Access-Control-Request-Method": "POST"})
    assert preflight.headers["access-control-allow-origin"] == "https://chat.example.com"
    # Only the ingress rolled. The platform was served with --address, so each replica resolved its own source;
    # apply built the change the same way, and so every engine kept its version (built with sources resolved on
    # the driver, as before, each engine's version changed and Serve started four new replicas before apply
    # returned).
    assert engine_replicas() == engines


def test_a_node_lost_under_load_fails_fast_and_its_replicas_return_on_a_new_node(platform):
    cluster = platform.cluster
    # Prompts whose 48 greedy tokens all have text: the random tiny model answers a few prompts (e.g.
    # "request 61: w61 w62 ...") with tokens that detokenize to nothing, which the bench counts as failed.
    specs = [RequestSpec(prompt=" ".join(f"w{(i + j) % 89}" for j in range(48)), prompt_len=48, max_tokens=48)
             for i in range(NUM_LOAD_REQUESTS)]
    config = BenchConfig(base_url=platform.base_url, model="small", ignore_eos=True, request_rate=4.0,
                         timeout_s=120)

    async def load_with_node_loss() -> tuple:
        bench = asyncio.ensure_future(run_benchmark(config, specs))
        await asyncio.sleep(8)  # both replicas are streaming by now (4 req/s)
        killed_at = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, cluster.kill_node, "a")
        return await bench, killed_at

    result, killed_at = asyncio.run(load_with_node_loss())
    failures = [record for record in result.records if not record.ok]
    served_by = {record.routing.get("x-fleetserve-replica") for record in result.records if record.ok}
    print(f"node a lost under load: {result.metrics['completed']} of {NUM_LOAD_REQUESTS} completed, "
          f"{len(failures)} failed: {sorted({record.error for record in failures})[:5]}; request ids "
          f"{[record.request_id for record in failures]}")
    # Nothing hung: every request ended, well inside its timeout, and each failure says why.
    assert len(result.records) == NUM_LOAD_REQUESTS
    assert all(record.e2el is not None and record.e2el < 60 for record in result.records if record.ok)
    unclear = {record.error for record in failures
               if not record.refused and "engine is unavailable" not in (record.error or "")}
    assert not unclear, unclear
    # Only requests streaming from a's replica when it died can fail: b's kept serving.
    assert result.metrics["completed"] >= NUM_LOAD_REQUESTS // 2 and len(served_by) == 2
    # The head marks the node dead.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = {node["node_id"]: node["alive"] for node in cluster.list_nodes()}
        if not alive[cluster.nodes["a"].node_id]:
            break
        time.sleep(1)
    assert not alive[cluster.nodes["a"].node_id]
    # b's replicas serve on: small's lost replica waits, since no other node has a free small slice, and pd,
    # whose prefill pool was on a, prefills on its decode replica until a prefill replica runs again.
    assert complete(platform.base_url, "small").status_code == 200
    local = complete(platform.base_url, "pd")
    assert local.status_code == 200, local.text
    assert HEADER_PREFILL_REPLICA not in local.headers and local.headers["x-fleetserve-pool"] == "decode"
    # A replacement node (what a RayService's worker group would start) takes the lost replicas.
    cluster.start_node("a2", WORKERS["a"])
    replaced = {("small", "colocated"): ["a2", "b"], ("pd", "prefill"): ["a2"], ("pd", "decode"): ["b"]}
    nodes = platform.wait_placed(replaced, timeout_s=300)
    recovery_s = time.monotonic() - killed_at
    print(f"every replica serves again {recovery_s:.0f} s after the loss")
    assert nodes == replaced
    # Both small replicas serve: 16 prompts neither engine has cached, sent at once, spread by load (prompts of
    # the load above would all go to b's replica, which holds their prefixes, within its 32-request imbalance
    # bound). The ingress's router gets a2's replica from Serve once Serve runs it, which can come after the
    # replica's node report above (a fresh-clone run saw 16 of 16 on b's replica right after the report).
    replicas = spread_over(platform.base_url, "small", timeout_s=30)
    assert len(replicas) == 2, replicas
    # pd's decode replica prefills remotely again once it sees the new prefill replica RUNNING in Serve's status
    # (the replica's node report above can come first; the decode side's count is up to 2 s old).
    remote = complete_prefilled_remotely(platform.base_url, "pd", timeout_s=30)
    assert remote.status_code == 200 and HEADER_PREFILL_REPLICA in remote.headers, remote.headers
    # No port lease outlived its engine: a's replicas' leases went with them, and the four replicas serving
    # now hold the only ones (NIXL side channels of pd's prefill and decode, KV event ports of small's two).
    owners = set(json.loads(cluster.port_registry.read_text()).values())
    assert len(owners) == 4 and all(psutil.pid_exists(pid) for pid in owners), owners
    # And no engine serving now holds anything for the requests that died with a: none running or waiting,
    # no KV block in use (pd's decode replica freed what it had pulled from a's prefill replica).
    for model in ("small", "pd"):
        gauges = wait_all_idle(platform.base_url, model, num_replicas=2)
        assert len(gauges) == 2 and all(g == {"running": 0.0, "waiting": 0.0, "kv": 0.0}
                                        for g in gauges.values()), gauges
