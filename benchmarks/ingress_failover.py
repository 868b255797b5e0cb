"""An ingress replica killed under load: what its requests and everyone else's get, and how soon Serve has two
again.

    .venv/bin/python benchmarks/ingress_failover.py [--rate 8] [--seconds 60] [--kill-at-s 20]   # ~2 min

The tiny model on 2 engine replicas (one core each) behind 2 ingress replicas (`server.num_ingress_replicas`,
the chart's default). An open loop of streamed requests (Poisson, `--rate` per second, 64 tokens in,
`--max-tokens` out, 256 by default)
runs for `--seconds`; at `--kill-at-s` one ingress replica is killed as a crash would (`ray.kill`), and Serve
starts a replacement. Requests are split by when they were sent and ended: in flight at the kill, or sent
after it. Reported: outcomes per group (completed; failed with an HTTP error or an error event; cut, i.e. a
stream ended before `data: [DONE]`), the last failure's time after the kill, and when Serve reported both
ingress replicas healthy again. Results: results/ingress-failover/*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import threading
import time
from collections import Counter
from pathlib import Path

from fleetserve.loadtest.client import CUT_STREAM, EMPTY_STREAM
from fleetserve.loadtest.datasets import RequestSpec
from fleetserve.loadtest.report import save_results
from fleetserve.loadtest.runner import BenchConfig, run_benchmark
from fleetserve.platform.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
PORT = 8048
APP = "fleetserve"
MODEL = "tiny"


def config():
    return parse_config({"server": {"num_ingress_replicas": 2}, "models": [{
        "name": MODEL, "source": "tiny-random-llama", "replicas": 2,
        "engine_args": {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 64 * 2**20,
                        "max_num_seqs": 32, "extra": {"enforce_eager": True}},
        "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]}}]})


def outcome(record) -> str:
    """completed, cut (ended before [DONE]) or failed (an HTTP error, an error event, a connection error). The
    random tiny model answers some prompts with tokens that detokenize to nothing: served, so completed."""
    if record.ok or record.error == EMPTY_STREAM:
        return "completed"
    return "cut" if record.error == CUT_STREAM else "failed"


def ingress_replicas() -> list[str]:
    import ray

    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["name"].startswith(f"SERVE_REPLICA::{APP}#ingress#"))


def healthy_ingresses() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["ingress"]
    return status.replica_states.get("RUNNING", 0)


class Killer(threading.Thread):
    """Kills one ingress replica ``kill_at_s`` from now, then times Serve's recovery (wall-clock seconds, as
    the load tester's ``started_at``)."""

    def __init__(self, kill_at_s: float) -> None:
        super().__init__(daemon=True)
        self.kill_at_s = kill_at_s
        self.killed_at: float | None = None
        self.victim: str | None = None
        self.recovered_at: float | None = None

    def run(self) -> None:
        import ray

        time.sleep(self.kill_at_s)
        self.victim = ingress_replicas()[0]
        ray.kill(ray.get_actor(self.victim, namespace="serve"), no_restart=True)
        self.killed_at = time.time()
        while time.time() < self.killed_at + 120:
            time.sleep(0.5)
            replicas = ingress_replicas()
            if self.victim not in replicas and len(replicas) == 2 and healthy_ingresses() == 2:
                self.recovered_at = time.time()
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-at-s", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ingress-failover")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import ray
    from ray import serve

    from fleetserve.deployments.builders import build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        serve.run(build_app(config()), name=APP, route_prefix="/")
        print(f"ingress replicas: {ingress_replicas()}", flush=True)
        bench = BenchConfig(base_url=f"http://127.0.0.1:{PORT}", model=MODEL, ignore_eos=True,
                            request_rate=args.rate, max_seconds=args.seconds, timeout_s=120.0, seed=1)
        specs = [RequestSpec(prompt=" ".join(f"w{(i + j) % 97}" for j in range(64)), prompt_len=64,
                             max_tokens=args.max_tokens)
                 for i in range(int(args.rate * args.seconds) + 50)]
        killer = Killer(args.kill_at_s)
        killer.start()
        result = asyncio.run(run_benchmark(bench, specs))
        killer.join()
        save_results(args.out / "failover.json", [result], detailed=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    report(result, killer)


def report(result, killer: Killer) -> None:
    """The outcomes by group, on the load tester's clock (seconds since its run started)."""
    kill = killer.killed_at - result.started_at
    records = result.records
    groups: dict[str, Counter] = {"before": Counter(), "in flight at the kill": Counter(), "sent after": Counter()}
    last_failure = None
    for record in records:
        # A request cut by a connection error has no end time: it was in flight at the kill.
        end = math.inf if record.e2el is None else record.start + record.e2el
        group = "before" if end < kill else "in flight at the kill" if record.start < kill else "sent after"
        result = outcome(record)
        groups[group][result] += 1
        if result != "completed" and record.start >= kill:
            last_failure = max(last_failure or 0.0, end - kill)
    print(f"\nkilled {killer.victim} at {kill:.1f} s")
    print("\n| requests | sent | completed | failed (error) | cut (no [DONE]) |\n|---|---|---|---|---|")
    for name, counts in groups.items():
        print(f"| {name} | {sum(counts.values())} | {counts['completed']} | {counts['failed']} | {counts['cut']} |")
    recovered = (f"{killer.recovered_at - killer.killed_at:.1f} s" if killer.recovered_at is not None
                 else "not within 120 s")
    print(f"\nlast failure of a request sent after the kill: "
          f"{'none' if last_failure is None else f'{last_failure:.1f} s after it'}")
    print(f"both ingress replicas running again: {recovered} after the kill")


if __name__ == "__main__":
    main()
