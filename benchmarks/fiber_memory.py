"""Resident memory an async Ray actor keeps after bursts of concurrent tasks: glibc as it is, against the
tuning fleetserve's Serve replicas apply (fleetserve.deployments.allocator).

    .venv/bin/python benchmarks/fiber_memory.py [--tasks 2000] [--bursts 3]     # ~2 min

Every task of an async actor runs on a fiber with a 256 KiB stack, so a burst of concurrent requests
costs the replica memory that glibc may keep after the burst (docs/benchmarks.md, "Ingress memory").
Each mode starts a fresh actor, sends --bursts bursts of --tasks concurrent tasks (each sleeps 3 s), and
samples the actor's RSS. Modes:

  glibc       the allocator untouched (FLEETSERVE_TUNE_MALLOC=0)
  pinned      the mmap threshold pinned at 128 KiB, no trim
  trimmed     the periodic trim alone (read after the next trim)
  fleetserve  the pin and the periodic trim, as replicas run (read after the next trim)

Results: results/fiber-memory/fiber-memory.json, a table on stdout, and a plot, fiber-memory.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import psutil
import ray

from fleetserve.deployments.allocator import (TRIM_INTERVAL_S, TUNE_ENV, pin_mmap_threshold, trim_periodically,
                                             tune_for_serving)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("glibc", "pinned", "trimmed", "fleetserve")
TASK_S = 3.0


@ray.remote(max_concurrency=100_000, num_cpus=0)
class BurstActor:
    """An async actor whose allocator is tuned as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        if mode == "pinned":
            pin_mmap_threshold()
        elif mode == "trimmed":
            self._trim = asyncio.get_event_loop().create_task(trim_periodically())
        elif mode == "fleetserve":
            self._trim = tune_for_serving(asyncio.get_event_loop())

    def pid(self) -> int:
        return os.getpid()

    async def hold(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def run_mode(mode: str, num_tasks: int, num_bursts: int) -> dict:
    """RSS samples (seconds, MiB) through the bursts, and the figures read from them."""
    env = {TUNE_ENV: "0"} if mode == "glibc" else {}
    actor = BurstActor.options(runtime_env={"env_vars": env}).remote(mode)
    pid = ray.get(actor.pid.remote())
    ray.get([actor.hold.remote(0.0) for _ in range(50)])
    start = time.monotonic()
    samples = [(0.0, rss_mib(pid))]

    def sample_until(refs: list, at_least_s: float) -> None:
        until = time.monotonic() + at_least_s
        while time.monotonic() < until or (refs and ray.wait(refs, num_returns=len(refs), timeout=0)[1]):
            samples.append((time.monotonic() - start, rss_mib(pid)))
            time.sleep(0.1)

    after_bursts = []
    for burst in range(num_bursts):
        refs = [actor.hold.remote(TASK_S) for _ in range(num_tasks)]
        sample_until(refs, TASK_S + 1.0)
        after_bursts.append(samples[-1][1])
        print(f"{mode}: burst {burst + 1}, RSS {after_bursts[-1]:.0f} MiB after it", flush=True)
    if mode in ("trimmed", "fleetserve"):
        sample_until([], TRIM_INTERVAL_S)  # the next periodic trim falls in this wait
    ray.kill(actor)
    baseline, peak, end = samples[0][1], max(rss for _, rss in samples), samples[-1][1]
    return {"mode": mode, "tasks": num_tasks, "baseline_mib": baseline, "peak_mib": peak,
            "after_bursts_mib": after_bursts, "end_mib": end,
            "kept_share": (end - baseline) / (peak - baseline), "samples": samples}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5))
    for run in runs:
        axis.plot([t for t, _ in run["samples"]], [rss for _, rss in run["samples"]],
                  label=f"{run['mode']}: keeps {run['kept_share']:.0%} of the peak's growth")
    axis.set_xlabel(f"seconds (bursts of {runs[0]['tasks']} concurrent tasks, {TASK_S:g} s each)")
    axis.set_ylabel("actor RSS (MiB)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=2000, help="concurrent tasks per burst")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fiber-memory")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        runs = [run_mode(mode, args.tasks, args.bursts) for mode in MODES]
    finally:
        ray.shutdown()
    (args.out / "fiber-memory.json").write_text(json.dumps(runs, indent=1))
    plot(runs, args.out / "fiber-memory.png")
    print("| mode | RSS before (MiB) | peak | after each burst | at the end | share of the growth kept |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        bursts = " / ".join(f"{rss:.0f}" for rss in run["after_bursts_mib"])
        print(f"| {run['mode']} | {run['baseline_mib']:.0f} | {run['peak_mib']:.0f} | {bursts} | "
              f"{run['end_mib']:.0f} | {run['kept_share']:.0%} |")


if __name__ == "__main__":
    main()
