"""An OpenAI batch file three ways, in one run: vLLM's offline `run-batch` (its own engine, started for the job),
and `fleetserve batch` against a running bare `vllm serve` and a running fleetserve. Same model, engine args, cores
and file.

    .venv/bin/python benchmarks/batch.py [--num-requests 128] [--max-concurrency 64]

Prints a markdown table: wall seconds (run-batch's includes its engine's start, which a running server has paid
already), completion tokens per second of wall time, and the ratio to bare vLLM's.
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
import time
from pathlib import Path

import yaml

from fleetserve.loadtest.batch import BatchConfig, read_batch, run_batch
from fleetserve.loadtest.local_server import free_port, wait_until_ready
from fleetserve.platform.config import parse_config
from fleetserve.platform.model_store import resolve_source
from fleetserve.platform.openai_app import cli_flags, vllm_serve_command

BINDING = "0-1"
MODEL = {"name": "smollm2", "source": "smollm2-135m-instruct",
         "engine_args": {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * 2**20,
                         "max_num_seqs": 128, "max_num_batched_tokens": 2048},
         "resources": {"num_cpus": 0.1, "cpu_binding": [BINDING]}}
MAX_TOKENS = 64


def batch_file(folder: Path, num_requests: int) -> Path:
    """Chat requests of ~100-word prompts, each generating exactly MAX_TOKENS tokens."""
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    rng = random.Random(0)
    path = folder / "batch.jsonl"
    with path.open("w") as out:
        for index in range(num_requests):
            prompt = " ".join(rng.choice(words) for _ in range(100))
            body = {"model": MODEL["name"], "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
            out.write(json.dumps({"custom_id": f"r{index}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")
    return path


def completion_tokens(output: Path) -> int:
    answers = [json.loads(line) for line in output.read_text().splitlines()]
    assert all(answer["response"]["status_code"] == 200 for answer in answers), "a request failed"
    return sum(answer["response"]["body"]["usage"]["completion_tokens"] for answer in answers)


def run_offline(source: Path, folder: Path) -> tuple[float, int]:
    model = parse_config({"models": [MODEL]}).models[0]
    output = folder / "run-batch.jsonl"
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.run_batch", "-i", str(source), "-o", str(output),
               "--model", str(resolve_source(model.source)), "--served-model-name", model.name,
               *cli_flags(model.engine_kwargs())]
    started = time.monotonic()
    subprocess.run(command, check=True, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": BINDING},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - started, completion_tokens(output)


def run_client(url: str, source: Path, output: Path, max_concurrency: int) -> tuple[float, int]:
    started = time.monotonic()
    asyncio.run(run_batch(BatchConfig(url, max_concurrency), read_batch(source), output))
    return time.monotonic() - started, completion_tokens(output)


def run_vllm(source: Path, folder: Path, max_concurrency: int) -> tuple[float, int]:
    model = parse_config({"models": [MODEL]}).models[0]
    port = free_port()
    process = subprocess.Popen(vllm_serve_command(model, port=port), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": BINDING})
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=process)
        return run_client(f"http://127.0.0.1:{port}", source, folder / "vllm.jsonl", max_concurrency)
    finally:
        process.terminate()
        process.wait(timeout=60)


def run_fleetserve(source: Path, folder: Path, max_concurrency: int) -> tuple[float, int]:
    config = folder / "fleetserve.yaml"
    port = free_port()
    config.write_text(yaml.safe_dump({"models": [MODEL]}))
    process = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", str(config), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if not process.stdout.readline().startswith("READY"):
            raise RuntimeError("fleetserve did not start")
        return run_client(f"http://127.0.0.1:{port}", source, folder / "fleetserve.jsonl", max_concurrency)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=64)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    source = batch_file(folder, args.num_requests)
    results = {}
    for name, run in (("vLLM run-batch (offline, engine start included)", lambda: run_offline(source, folder)),
                      ("fleetserve batch -> bare vllm serve", lambda: run_vllm(source, folder, args.max_concurrency)),
                      ("fleetserve batch -> fleetserve", lambda: run_fleetserve(source, folder,
                                                                                args.max_concurrency))):
        print(f"running {name}...", flush=True)
        results[name] = run()
    reference = results["fleetserve batch -> bare vllm serve"]
    print(f"\n{args.num_requests} chat requests x {MAX_TOKENS} tokens, SmolLM2 bf16 on cores {BINDING}, "
          f"client concurrency {args.max_concurrency}\n")
    print("| how | wall s | completion tok/s | vs bare vLLM |")
    print("|---|---|---|---|")
    for name, (seconds, tokens) in results.items():
        rate = tokens / seconds
        print(f"| {name} | {seconds:.1f} | {rate:.0f} | {rate / (reference[1] / reference[0]):.2f}x |")


if __name__ == "__main__":
    main()
