"""fleetserve vs bare vLLM vs Ray Serve LLM: same model, same engine args, same cores, same workload, in one run.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--num-prompts 64] [--concurrency 4,16,64] [--binding 0-1,1]
        [--stream-interval 1,4]

Each server runs alone, its engine pinned to the same cores as the others', and is measured with `fleetserve bench`'s
runner (warm-ups first). Prints markdown tables of the figures, the ratios to bare vLLM, and each process group's CPU
time per streamed output token. Ray Serve LLM needs pyarrow (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import yaml

from fleetserve.loadtest.local_server import wait_until_ready
from fleetserve.platform.openai_app import vllm_serve_command
from fleetserve.loadtest.datasets import PromptMaker, random_dataset
from fleetserve.loadtest.report import save_results
from fleetserve.loadtest.runner import BenchConfig, RunResult, run_benchmark
from fleetserve.platform.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
# Batch limits set explicitly, so no server's own defaults differ from another's.
MODEL = {"name": "smollm2", "source": "smollm2-135m-instruct",
         "engine_args": {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * 2**20,
                         "max_num_seqs": 128, "max_num_batched_tokens": 2048},
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
        if process.name() == "haproxy":  # by name: a command line may hold the word (an --out folder)
            return "Serve HTTP proxy"
        name = " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    for marker, group in (("VLLM::Worker", "vLLM worker (model compute)"), ("VLLM::EngineCore", "vLLM engine core"),
                          ("ServeReplica:fleetserve:engine", "engine replica (AsyncLLM front-end)"),
                          ("ServeReplica:fleetserve:ingress", "ingress replica (FastAPI)"),
                          ("ServeReplica:ray-serve-llm:LLMServer", "engine replica (AsyncLLM front-end)"),
                          ("ServeReplica:ray-serve-llm:OpenAiIngress", "ingress replica (FastAPI)"),
                          ("ServeReplica:ray-serve-llm", "ingress replica (FastAPI)"),
                          ("ProxyActor", "Serve HTTP proxy"),
                          ("ServeReplica:fleetserve:metrics", "metrics hub"),
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
        used = {group: after[group] - before.get(group, 0.0) for group in after
                if after[group] - before.get(group, 0.0) > 0.01}
        # Share of the 2 cores each part used during the measured run (warm-ups are included: small).
        result.metrics["cpu_share"] = {group: seconds / duration for group, seconds in used.items()}
        # CPU milliseconds each part spent per streamed output token.
        result.metrics["cpu_ms_per_token"] = {group: 1000 * seconds / result.metrics["total_output_tokens"]
                                              for group, seconds in used.items()}
        results.append(result)
        print(f"  concurrency {concurrency}: {result.metrics['output_throughput']:.1f} tok/s", flush=True)
    return results


def model_entry(binding: str, stream_interval: int = 1) -> dict:
    return {**MODEL, "engine_args": {**MODEL["engine_args"], "stream_interval": stream_interval},
            "resources": {**MODEL["resources"], "cpu_binding": [binding]}}


def run_vllm(specs, concurrencies, port: int, binding: str, stream_interval: int) -> list[RunResult]:
    model = parse_config({"models": [model_entry(binding, stream_interval)]}).models[0]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": binding}
    process = subprocess.Popen(vllm_serve_command(model, port=port), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=process)
        return measure(f"http://127.0.0.1:{port}", specs, concurrencies)
    finally:
        process.terminate()
        process.wait(timeout=60)


def _run_until_ready(command: list[str], name: str, specs, concurrencies, port: int) -> list[RunResult]:
    """Starts a server that prints READY when it serves, measures it, and stops it with SIGINT."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if not process.stdout.readline().startswith("READY"):
            raise RuntimeError(f"{name} did not start")
        return measure(f"http://127.0.0.1:{port}", specs, concurrencies)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)


def run_fleetserve(specs, concurrencies, port: int, binding: str, stream_interval: int) -> list[RunResult]:
    config_path = Path(tempfile.mkdtemp()) / "bench.yaml"
    config_path.write_text(yaml.safe_dump({"models": [model_entry(binding, stream_interval)]}))
    return _run_until_ready([sys.executable, "-m", "fleetserve.cli", "serve", str(config_path), "--port", str(port)],
                            "fleetserve", specs, concurrencies, port)


def run_ray_serve_llm(specs, concurrencies, port: int, binding: str, stream_interval: int) -> list[RunResult]:
    entry = json.dumps(model_entry(binding, stream_interval))
    return _run_until_ready([sys.executable, str(ROOT / "benchmarks" / "ray_serve_llm_server.py"), entry, str(port),
                             binding], "Ray Serve LLM", specs, concurrencies, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", default="4,16,64")
    parser.add_argument("--binding", default="0-1,1",
                        help="engine core bindings to compare, comma-separated; each is used by both servers")
    parser.add_argument("--stream-interval", default="1",
                        help="vLLM's stream_interval values to compare, comma-separated; each is given to every server")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "serve_vs_vllm")
    args = parser.parse_args()
    concurrencies = [int(part) for part in args.concurrency.split(",")]
    specs = workload(args.num_prompts)
    for binding in args.binding.split(","):
        for stream_interval in [int(part) for part in args.stream_interval.split(",")]:
            setup = f"engine on cores {binding}, stream_interval {stream_interval}"
            print(f"{setup}: bare vLLM ...", flush=True)
            vllm = run_vllm(specs, concurrencies, 8011, binding, stream_interval)
            print(f"{setup}: Ray Serve LLM ...", flush=True)
            ray_llm = run_ray_serve_llm(specs, concurrencies, 8013, binding, stream_interval)
            print(f"{setup}: fleetserve ...", flush=True)
            ours = run_fleetserve(specs, concurrencies, 8012, binding, stream_interval)
            servers = {"bare vLLM": vllm, "Ray Serve LLM": ray_llm, "fleetserve": ours}
            suffix = f"cores{binding}" + (f"-interval{stream_interval}" if stream_interval > 1 else "")
            for name, results in servers.items():
                save_results(args.out / f"{name.replace(' ', '-').lower()}-{suffix}.json", results, detailed=False)
            report(setup, concurrencies, servers)


def report(setup: str, concurrencies: list[int], servers: dict[str, list[RunResult]]) -> None:
    """Markdown tables: each figure per server with its ratio to bare vLLM, then CPU per token per group."""
    names = list(servers)
    print(f"\n### {setup}\n")
    print("| concurrency | figure | " + " | ".join(names) + " | " +
          " | ".join(f"{name} / vLLM" for name in names[1:]) + " |")
    print("|---" * (2 + 2 * len(names) - 1) + "|")
    for index, concurrency in enumerate(concurrencies):
        for key in FIGURES:
            values = [servers[name][index].metrics[key] for name in names]
            print(f"| {concurrency} | {key} | " + " | ".join(f"{value:.1f}" for value in values) + " | " +
                  " | ".join(f"{value / values[0]:.3f}" for value in values[1:]) + " |")
    print("\nCPU ms per streamed output token:\n")
    print("| concurrency | process group | " + " | ".join(names) + " |\n" + "|---" * (2 + len(names)) + "|")
    for index, concurrency in enumerate(concurrencies):
        per_token = [servers[name][index].metrics["cpu_ms_per_token"] for name in names]
        for group in sorted(set().union(*per_token)):
            print(f"| {concurrency} | {group} | " + " | ".join(f"{shares.get(group, 0.0):.2f}" for shares in per_token)
                  + " |")


if __name__ == "__main__":
    main()
