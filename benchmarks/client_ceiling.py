"""The load tester's own ceiling: how much load it sustains before its timing skews.

    .venv/bin/python benchmarks/client_ceiling.py

Runs `fleetserve bench`'s runner against the fixed-schedule server from the tests (first token
after 100 ms, then one every 20 ms, 50 tokens). Any measured deviation from that schedule is the
client's (or the server's, which shares the same 2 cores: so these are lower bounds).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fleetserve.loadtest.datasets import RequestSpec
from fleetserve.loadtest.runner import BenchConfig, run_benchmark

ROOT = Path(__file__).resolve().parents[1]
FIRST_MS, ITL_MS, TOKENS = 100.0, 20.0, 50


def start_server(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "loadtest" / "schedule_server.py"), "--port",
                                str(port), "--first-ms", str(FIRST_MS), "--itl-ms", str(ITL_MS)])
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return process
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("schedule server did not start")


def row(label: str, metrics: dict, duration: float) -> str:
    ttft_err = metrics["median_ttft_ms"] - FIRST_MS
    ttft_p99_err = metrics["p99_ttft_ms"] - FIRST_MS
    itl_p99_err = metrics["p99_itl_ms"] - ITL_MS
    chunks = metrics["total_output_tokens"] / duration
    return (f"| {label} | {metrics['request_throughput']:.1f} | {chunks:.0f} | {ttft_err:+.1f} | {ttft_p99_err:+.1f} "
            f"| {metrics['median_itl_ms'] - ITL_MS:+.2f} | {itl_p99_err:+.1f} |")


def main() -> None:
    port = 8031
    server = start_server(port)
    url = f"http://127.0.0.1:{port}"
    print("| load | req/s achieved | chunks/s | TTFT p50 error (ms) | TTFT p99 error (ms) | ITL p50 error (ms) "
          "| ITL p99 error (ms) |\n|---|---|---|---|---|---|---|")
    try:
        for rate in (5, 10, 20, 40, 80):
            num = int(rate * 8)  # ~8 s of arrivals
            config = BenchConfig(base_url=url, model="schedule", request_rate=rate, num_warmups=4, percentiles=[50, 99])
            result = asyncio.run(run_benchmark(config, [RequestSpec("x", 1, TOKENS)] * num))
            print(row(f"rate {rate}/s (~{rate * (FIRST_MS + ITL_MS * (TOKENS - 1)) / 1000:.0f} streams)",
                      result.metrics, result.metrics["duration"]), flush=True)
        for concurrency in (32, 64, 128, 256):
            config = BenchConfig(base_url=url, model="schedule", request_rate=math.inf, max_concurrency=concurrency,
                                 num_warmups=4, percentiles=[50, 99])
            result = asyncio.run(run_benchmark(config, [RequestSpec("x", 1, TOKENS)] * (concurrency * 3)))
            print(row(f"{concurrency} concurrent", result.metrics, result.metrics["duration"]), flush=True)
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
