"""fleetserve vs bare vLLM: same model, same engine args, same cores, same workload, in one run.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--num-prompts 64] [--concurrency 4,16]

Each server runs alone, pinned to the same cores, and is measured with `fleetserve bench`'s runner
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


def measure(url: str, specs, concurrencies: list[int]) -> list[RunResult]:
    results = []
    for concurrency in concurrencies:
        config = BenchConfig(base_url=url, model="smollm2", max_concurrency=concurrency, num_warmups=4,
                             ignore_eos=True, percentiles=[50, 99],
                             dataset={"name": "random", "input_len": 256, "output_len": 128})
        results.append(asyncio.run(run_benchmark(config, specs)))
        print(f"  concurrency {concurrency}: {results[-1].metrics['output_throughput']:.1f} tok/s", flush=True)
    return results


def run_vllm(specs, concurrencies, port: int) -> list[RunResult]:
    model = parse_config({"models": [MODEL]}).models[0]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    process = subprocess.Popen(bare_vllm_command(model, port=port), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=process)
        return measure(f"http://127.0.0.1:{port}", specs, concurrencies)
    finally:
        process.terminate()
        process.wait(timeout=60)


def run_fleetserve(specs, concurrencies, port: int) -> list[RunResult]:
    config_path = Path(tempfile.mkdtemp()) / "bench.yaml"
    config_path.write_text(yaml.safe_dump({"models": [MODEL]}))
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
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "serve_vs_vllm")
    args = parser.parse_args()
    concurrencies = [int(part) for part in args.concurrency.split(",")]
    specs = workload(args.num_prompts)
    print("bare vLLM ...", flush=True)
    vllm = run_vllm(specs, concurrencies, port=8011)
    print("fleetserve ...", flush=True)
    ours = run_fleetserve(specs, concurrencies, port=8012)
    save_results(args.out / "vllm.json", vllm, detailed=False)
    save_results(args.out / "fleetserve.json", ours, detailed=False)
    print("\n| concurrency | figure | bare vLLM | fleetserve | fleetserve / vLLM |\n|---|---|---|---|---|")
    for concurrency, theirs, mine in zip(concurrencies, vllm, ours, strict=True):
        for key in FIGURES:
            a, b = theirs.metrics[key], mine.metrics[key]
            print(f"| {concurrency} | {key} | {a:.1f} | {b:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
