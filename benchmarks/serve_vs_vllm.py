"""fleetserve vs bare vLLM: same model, same engine args, same cores, same workload, in one run.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--num-prompts 64] [--concurrency 4,16] [--binding 0-1,1]

Each server runs alone, its engine pinned to the same cores as the other's, and is measured with `fleetserve bench`'s runner
(warm-ups first). Prints a markdown table of the figures and the ratios fleetserve / vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import yaml

from fleetserve.loadtest.baseline import bare_vllm_command, wait_until_ready
from fleetserve.loadtest.datasets import PromptMaker, random_dataset
from fleetserve.loadtest.report import save_results
from fleetserve.loadtest.runner import BenchConfig, RunResult, run_benchmark
from fleetserve.platform.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"name": "smollm2", "source": "smollm2-135m-instruct",
         "engine_args": {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * 2**20},
         "resources": {"num_cpus": 0.1, "cpu_binding": ["0-1"]}}
FIGURES = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms"]
# For latencies lower is better; the ratio is still fleetserve / vLLM.


def workload(num_prompts: int):
    from transformers import AutoTokenizer

    from fleetserve.platform.model_store import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source(MODEL["source"])))
    return random_dataset(num_prompts, input_len=256, output_len=128, range_ratio=0.0, prefix_len=0,
                          maker=PromptMaker(tokenizer, random.Random(0)))


def _group(process: psutil.Process) -> str | None:
    """Which part of a serving stack a process is, by its title or command line."""
    try:
        name = " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    for marker, group in (("VLLM::Worker", "vLLM worker (model compute)"), ("VLLM::EngineCore", "vLLM engine core"),
                          ("ServeReplica:fleetserve:engine", "engine replica (AsyncLLM front-end)"),
                          ("ServeReplica:fleetserve:ingress", "ingress replica (FastAPI)"),
                          ("ProxyActor", "Serve HTTP proxy"), ("ServeReplica:fleetserve:metrics", "metrics hub"),
                          ("api_server", "vLLM API server (front-end)"), ("serve_vs_vllm", "load tester"),
                          ("ServeController", "Ray and Serve control plane"), ("raylet", "Ray and Serve control plane"),
                          ("gcs_server", "Ray and Serve control plane"), ("ray::", "Ray and Serve control plane"),
                          ("/ray/", "Ray and Serve control plane")):
        if marker in name:
            return group
    return None


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far, summed per part of the stack."""
    totals: dict[str, float] = {}
    for process in psutil.process_iter():
        group = _group(process)
        if group is None:
            continue
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        totals[group] = totals.get(group, 0.0) + times.user + times.system
    return totals


def measure(url: str, specs, concurrencies: list[int]) -> list[RunResult]:
    results = []
    for concurrency in concurrencies:
        config = BenchConfig(base_url=url, model="smollm2", max_concurrency=concurrency, num_warmups=4,
                             ignore_eos=True, percentiles=[50, 99],
                             dataset={"name": "random", "input_len": 256, "output_len": 128})
        before = cpu_seconds()
        result = asyncio.run(run_benchmark(config, specs))
        after = cpu_seconds()
        duration = result.metrics["duration"]
        # Share of the 2 cores each part used during the measured run (warm-ups are included: small).
        result.metrics["cpu_share"] = {group: (after[group] - before.get(group, 0.0)) / duration
                                       for group in after if after[group] - before.get(group, 0.0) > 0.01}
        results.append(result)
        print(f"  concurrency {concurrency}: {result.metrics['output_throughput']:.1f} tok/s", flush=True)
    return results


def model_entry(binding: str) -> dict:
    return {**MODEL, "resources": {**MODEL["resources"], "cpu_binding": [binding]}}


def run_vllm(specs, concurrencies, port: int, binding: str) -> list[RunResult]:
    model = parse_config({"models": [model_entry(binding)]}).models[0]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": binding}
    process = subprocess.Popen(bare_vllm_command(model, port=port), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=process)
        return measure(f"http://127.0.0.1:{port}", specs, concurrencies)
    finally:
        process.terminate()
        process.wait(timeout=60)


def run_fleetserve(specs, concurrencies, port: int, binding: str) -> list[RunResult]:
    config_path = Path(tempfile.mkdtemp()) / "bench.yaml"
    config_path.write_text(yaml.safe_dump({"models": [model_entry(binding)]}))
    process = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", str(config_path), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if not process.stdout.readline().startswith("READY"):
            raise RuntimeError("fleetserve did not start")
        return measure(f"http://127.0.0.1:{port}", specs, concurrencies)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", default="4,16")
    parser.add_argument("--binding", default="0-1,1",
                        help="engine core bindings to compare, comma-separated; each is used by both servers")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "serve_vs_vllm")
    args = parser.parse_args()
    concurrencies = [int(part) for part in args.concurrency.split(",")]
    specs = workload(args.num_prompts)
    for binding in args.binding.split(","):
        print(f"engine bound to cores {binding}: bare vLLM ...", flush=True)
        vllm = run_vllm(specs, concurrencies, 8011, binding)
        print(f"engine bound to cores {binding}: fleetserve ...", flush=True)
        ours = run_fleetserve(specs, concurrencies, 8012, binding)
        save_results(args.out / f"vllm-cores{binding}.json", vllm, detailed=False)
        save_results(args.out / f"fleetserve-cores{binding}.json", ours, detailed=False)
        report(binding, concurrencies, vllm, ours)


def report(binding: str, concurrencies: list[int], vllm: list[RunResult], ours: list[RunResult]) -> None:
    print(f"\n### engine on cores {binding}\n")
    print("| concurrency | figure | bare vLLM | fleetserve | fleetserve / vLLM |\n|---|---|---|---|---|")
    for concurrency, theirs, mine in zip(concurrencies, vllm, ours, strict=True):
        for key in FIGURES:
            a, b = theirs.metrics[key], mine.metrics[key]
            print(f"| {concurrency} | {key} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    print("\n| concurrency | process group | bare vLLM (cores) | fleetserve (cores) |\n|---|---|---|---|")
    for concurrency, theirs, mine in zip(concurrencies, vllm, ours, strict=True):
        groups = sorted(set(theirs.metrics["cpu_share"]) | set(mine.metrics["cpu_share"]))
        for group in groups:
            print(f"| {concurrency} | {group} | {theirs.metrics['cpu_share'].get(group, 0.0):.2f} "
                  f"| {mine.metrics['cpu_share'].get(group, 0.0):.2f} |")


if __name__ == "__main__":
    main()
