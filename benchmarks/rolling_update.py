"""A change of engine args under load: `fleetserve apply` (Serve's rolling update) against stopping and
starting the model (what a platform without rolling updates does, bare `vllm serve` included).

    .venv/bin/python benchmarks/rolling_update.py [--rate 4] [--settle-s 20] [--out results/rolling-update]

One run serves the tiny model on 2 replicas (one core each) and, for each way of changing it, sends an open
loop of requests (Poisson, `--rate` per second, 128 tokens in, 32 out) that starts `--settle-s` before the
change and ends `--settle-s` after it is done. The change is the same both times: max_num_seqs 32 -> 24,
which restarts every engine. Requests are split by when they were sent: before, during and after the change.
Reported per window: requests, failures, and TTFT and end-to-end latency (p50, p99); plus a plot of every
request's TTFT over time with the change shaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from fleetserve.loadtest.arrivals import inter_arrival_times
from fleetserve.loadtest.client import EMPTY_STREAM, build_payload, send_request
from fleetserve.loadtest.datasets import PromptMaker, random_dataset
from fleetserve.loadtest.runner import BenchConfig
from fleetserve.platform.config import PlatformConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]
PORT = 8047
APP = "fleetserve"
MODEL = "tiny"
WINDOWS = ("before", "during", "after")


def config(max_num_seqs: int) -> PlatformConfig:
    return parse_config({"models": [{
        "name": MODEL, "source": "tiny-random-llama", "replicas": 2,
        "engine_args": {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 64 * 2**20,
                        "max_num_seqs": max_num_seqs, "extra": {"enforce_eager": True}},
        "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]}}]})


def failed_request(record) -> bool:
    """Whether a request failed. The random tiny model answers some prompts with tokens that detokenize to
    nothing: served, not failed (about 1 in 6 in every window, before the change too)."""
    return not record.ok and record.error != EMPTY_STREAM


@dataclass
class Outcome:
    """One way of changing the model, and the requests sent meanwhile."""

    method: str
    # Seconds since the load started: when the change began and when it was done.
    change_started_s: float = 0.0
    change_done_s: float = 0.0
    records: list = field(default_factory=list)

    def window(self, record) -> str:
        if record.start < self.change_started_s:
            return "before"
        return "during" if record.start <= self.change_done_s else "after"

    def summary(self) -> dict:
        rows = {}
        for name in WINDOWS:
            records = [record for record in self.records if self.window(record) == name]
            ok = [record for record in records if record.ok]
            ttft = [record.ttft * 1000 for record in ok]
            e2el = [record.e2el * 1000 for record in ok]

            def pct(values: list[float], q: float) -> float | None:
                return float(np.percentile(values, q)) if values else None

            empty = [record for record in records if record.error == EMPTY_STREAM]
            failed = [record for record in records if failed_request(record)]
            rows[name] = {"requests": len(records), "failed": len(failed), "empty": len(empty),
                          "errors": sorted({record.error for record in failed})[:3],
                          "p50_ttft_ms": pct(ttft, 50), "p99_ttft_ms": pct(ttft, 99),
                          "p50_e2el_ms": pct(e2el, 50), "p99_e2el_ms": pct(e2el, 99)}
        return {"method": self.method, "change_s": self.change_done_s - self.change_started_s, "windows": rows}


async def open_loop(specs, rate: float, started: float, stop_at: list[float]) -> list:
    """Sends ``specs`` at Poisson times (``rate``/s) from ``started`` (time.perf_counter()) until ``stop_at[0]``
    seconds after it; returns every sent request's record once all finish (none is cut short)."""
    endpoint = BenchConfig(base_url=f"http://127.0.0.1:{PORT}", model=MODEL).endpoint
    offsets = np.cumsum(inter_arrival_times(len(specs), rate, seed=0))
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None)) as http:
        tasks = []
        for spec, offset in zip(specs, offsets):
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            if time.perf_counter() - started > stop_at[0]:
                break
            payload = build_payload(spec, "completions", MODEL, ignore_eos=True)
            tasks.append(asyncio.create_task(send_request(http, endpoint, payload, "completions", started, spec)))
        return list(await asyncio.gather(*tasks))


def load_during(change, specs, rate: float, settle_s: float, method: str) -> Outcome:
    """Runs the open loop; calls ``change()`` once ``settle_s`` have passed, and stops sending ``settle_s``
    after it returns."""
    outcome = Outcome(method)
    stop_at = [float("inf")]
    started = time.perf_counter()
    loader = threading.Thread(target=lambda: setattr(outcome, "records", asyncio.run(
        open_loop(specs, rate, started, stop_at))))
    loader.start()
    time.sleep(settle_s)
    outcome.change_started_s = time.perf_counter() - started
    print(f"{method}: changing at {outcome.change_started_s:.0f} s", flush=True)
    change()
    outcome.change_done_s = time.perf_counter() - started
    print(f"{method}: done at {outcome.change_done_s:.0f} s", flush=True)
    stop_at[0] = outcome.change_done_s + settle_s
    loader.join()
    return outcome


def plot(outcomes: list[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(outcomes), 1, figsize=(9, 3.2 * len(outcomes)), sharey=True)
    for axis, outcome in zip(np.atleast_1d(axes), outcomes):
        ok = [record for record in outcome.records if record.ok]
        failed = [record for record in outcome.records if failed_request(record)]
        axis.axvspan(outcome.change_started_s, outcome.change_done_s, color="orange", alpha=0.2, label="change")
        axis.scatter([r.start for r in ok], [r.ttft for r in ok], s=6, label="TTFT (served)")
        if failed:
            axis.scatter([r.start for r in failed], [0] * len(failed), marker="x", color="red", s=14,
                         label=f"failed ({len(failed)})")
        axis.set_title(outcome.method)
        axis.set_xlabel("request sent at (s)")
        axis.set_ylabel("TTFT (s)")
        axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from fleetserve.deployments.apply import apply_config
    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.model_store import resolve_source

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "rolling-update")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source("tiny-random-llama")))
    specs = random_dataset(5000, input_len=128, output_len=32, range_ratio=0.0, prefix_len=0,
                           maker=PromptMaker(tokenizer, random.Random(0)))
    before, after = config(max_num_seqs=32), config(max_num_seqs=24)

    def roll() -> None:
        apply_config(after, app_name=APP, route_prefix="/")

    def restart() -> None:
        serve.delete(APP)
        serve.run(build_app(after), name=APP, route_prefix="/")

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    outcomes = []
    try:
        for method, change in (("fleetserve apply (rolling update)", roll), ("stop and start", restart)):
            print(f"{method}: deploying", flush=True)
            serve.run(build_app(before), name=APP, route_prefix="/")
            outcomes.append(load_during(change, specs, args.rate, args.settle_s, method))
            serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    summaries = [outcome.summary() for outcome in outcomes]
    (args.out / "summary.json").write_text(json.dumps(summaries, indent=1))
    plot(outcomes, args.out / "rolling-update.png")
    print(f"\ntiny, 2 replicas, {args.rate}/s Poisson, 128 in / 32 out; change: max_num_seqs 32 -> 24 "
          f"(restarts every engine)\n")
    print("| method | change took s | window | requests | failed | empty | p50 TTFT ms | p99 TTFT ms | p50 e2e ms "
          "| p99 e2e ms |\n|---|---|---|---|---|---|---|---|---|---|")
    for summary in summaries:
        for name, row in summary["windows"].items():
            cells = [f"{row[key]:.0f}" if row[key] is not None else "-"
                     for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p99_e2el_ms")]
            print(f"| {summary['method']} | {summary['change_s']:.0f} | {name} | {row['requests']} | "
                  f"{row['failed']} | {row['empty']} | {' | '.join(cells)} |")
    print(f"\nplot: {args.out / 'rolling-update.png'}")


if __name__ == "__main__":
    main()
