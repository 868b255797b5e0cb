"""Helpers for tests against Serve apps on the suite's Ray cluster: health, replica actors, engine gauges, a
shared-prefix routing workload."""

from __future__ import annotations

import random
import re
import time
from collections import defaultdict
from pathlib import Path

import httpx

from fleetserve.loadtest.datasets import PromptMaker, shared_prefix_dataset

# vLLM gauge -> short name, as engine_gauges() reports them.
GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:kv_cache_usage_perc": "kv"}


def wait_until_healthy(app: str, timeout_s: float = 240.0) -> float:
    """Waits until every deployment of a Serve app is HEALTHY; returns the seconds it took (inf on timeout)."""
    from ray import serve
    from ray.serve.schema import DeploymentStatus

    start = time.monotonic()
    while time.monotonic() < start + timeout_s:
        status = serve.status().applications.get(app)
        if status is not None and all(d.status == DeploymentStatus.HEALTHY for d in status.deployments.values()):
            return time.monotonic() - start
        time.sleep(0.5)
    return float("inf")


def running_replicas(app: str, deployment: str) -> int:
    """A deployment's RUNNING replicas, as Serve reports them."""
    from ray import serve

    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    """Polls ``predicate`` until it holds; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def replica_actors(deployment: str) -> list[str]:
    """Names of a deployment's live Serve replica actors."""
    import ray

    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                  if f"#{deployment}#" in actor["name"] and actor["name"].startswith("SERVE_REPLICA"))


def replica_logs(app: str, deployment: str) -> list[Path]:
    """The Serve log files of a deployment's replicas on this cluster, one per replica Serve started (failed
    starts included, where ``replica_actors`` sees only the live)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return sorted(logs.glob(f"replica_{app}_{deployment}_*.log"))


def kill(actor_name: str) -> None:
    """Kills a Serve replica actor the way a crash would (no graceful shutdown)."""
    import ray

    ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)


def _engine_core(replica) -> int | None:
    """The pid of the engine core a replica process started: the child vLLM titled ``VLLM::EngineCore``, else
    its one multiprocessing-spawned child. Full-suite runs have found LoRA replicas whose serving engine core
    kept the spawned interpreter's name and command line (no title), beside multiprocessing's resource tracker.
    """
    children = replica.children()
    titled = [child.pid for child in children
              if "EngineCor" in child.name() or "EngineCore" in " ".join(child.cmdline())]
    spawned = [child.pid for child in children if "multiprocessing.spawn" in " ".join(child.cmdline())]
    found = titled or spawned
    return found[0] if len(found) == 1 else None


def engine_core_pids(deployment: str, timeout_s: float = 120.0) -> dict[str, int]:
    """Replica id (as x-fleetserve-replica names it) -> the pid of the vLLM engine core process it started, for a
    deployment's live Serve replicas, found under each replica actor's own process (its pid from Ray's actor
    table; the actor's name ends with the replica id). Waits up to ``timeout_s`` for a replica still starting
    its engine (one Serve started in place of a dead one may not have yet)."""
    import psutil
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while True:
        actor_pids = {actor["Name"].rsplit("#", 1)[-1]: actor["Pid"] for actor in state.actors().values()
                      if actor["State"] == "ALIVE" and f"#{deployment}#" in (actor["Name"] or "")
                      and actor["Name"].startswith("SERVE_REPLICA")}
        try:
            cores = {replica_id: core for replica_id, pid in actor_pids.items()
                     if (core := _engine_core(psutil.Process(pid))) is not None}
        except psutil.NoSuchProcess:  # a replica that stopped since the actor table was read
            cores = {}
        if len(cores) == len(actor_pids) or time.monotonic() > deadline:
            break
        time.sleep(1)
    if len(cores) != len(actor_pids):
        seen = [(process.pid, process.ppid(), process.name(), " ".join(process.cmdline())[:60])
                for process in psutil.process_iter() if process.ppid() in actor_pids.values()
                or "VLLM" in " ".join(process.cmdline()) or "ServeReplica" in " ".join(process.cmdline())]
        raise AssertionError(f"replica actors {actor_pids} of {deployment} have engine cores {cores}; "
                             f"processes (pid, parent, name, command): {seen}")
    return cores


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of one metric in a Prometheus exposition, with its labels."""
    return [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
            for labels, value in re.findall(rf'^{re.escape(name)}{{([^}}]*)}} (\S+)$', text, re.M)]


def engine_gauges(base_url: str, model: str, headers: dict[str, str] | None = None,
                  ) -> dict[tuple[str, str], dict[str, float]]:
    """(pool, replica) -> {running, waiting, kv} for one model's replicas, from the app's /metrics (an admin
    key's ``headers`` where auth is on)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10, headers=headers).text
    gauges: dict[tuple[str, str], dict[str, float]] = {}
    for name, short in GAUGES.items():
        for labels, value in metric_values(text, name):
            if labels.get("model_name") == model:
                gauges.setdefault((labels["pool"], labels["replica"]), {})[short] = value
    return gauges


def wait_all_idle(base_url: str, model: str, num_replicas: int, timeout_s: float = 40.0,
                  headers: dict[str, str] | None = None) -> dict[tuple[str, str], dict[str, float]]:
    """The gauges once ``num_replicas`` replicas of the model report nothing running or waiting and no KV
    in use (or the last gauges seen, at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = engine_gauges(base_url, model, headers)
        idle = all(g == {"running": 0.0, "waiting": 0.0, "kv": 0.0} for g in gauges.values())
        if (idle and len(gauges) >= num_replicas) or time.monotonic() > deadline:
            return gauges
        time.sleep(1.0)


def send_workload(url: str, model: str) -> tuple[dict[int, set[str]], list[str], float]:
    """A shared-prefix workload for cache-aware routing: replicas per group, route reasons, engine hit rate."""
    # 8 groups x 4 requests, sequential so load never overrides affinity. Each prompt: ~400 shared words + 10 own.
    specs = shared_prefix_dataset(32, num_groups=8, prefix_len=300, suffix_len=10, output_len=2,
                                  maker=PromptMaker(None, random.Random(0)))
    replicas_by_group, reasons = defaultdict(set), []
    prompt_tokens = cached_tokens = 0
    with httpx.Client(timeout=120) as http:
        for spec in specs:
            response = http.post(f"{url}/completions", json={"model": model, "prompt": spec.prompt, "max_tokens": 2})
            assert response.status_code == 200, response.text
            replicas_by_group[spec.group_id].add(response.headers["x-fleetserve-replica"])
            reasons.append(response.headers.get("x-fleetserve-route-reason"))
            usage = response.json()["usage"]
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    # The engines' own count: prompt tokens served from their prefix caches.
    return replicas_by_group, reasons, cached_tokens / prompt_tokens
