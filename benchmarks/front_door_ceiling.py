"""The serving path's own ceiling: streamed tokens/s through Serve proxy, ingress and engine replica, with an
engine that produces tokens instantly (fleetserve.platform.instant_engine), and the CPU each part spends.

    .venv/bin/python benchmarks/front_door_ceiling.py [--concurrency 16,64] [--tokens 256] [--step-ms 30]
        [--serve-defaults] [--env KEY=VALUE ...]

The path runs on Serve's fast path (server.serve_fast_path: true, fleetserve's opt-in: gRPC between Serve's
processes, HAProxy as the HTTP front door); --serve-defaults runs Serve's defaults (serve_fast_path: false),
fleetserve's default. --env sets more Ray Serve options before Ray starts (RAY_SERVE_THROUGHPUT_OPTIMIZED=1),
so each run of the script measures one configuration of the path. --step-ms paces the engine as a real one
steps (one token per request per step), so each token is its own Ray item, as it is in front of vLLM.

The load tester shares the machine's 2 cores with the path, so the tokens/s are a lower bound; the CPU
milliseconds per token of each front-end process are not, and they decide how many front-end cores a
GPU replica's token rate needs.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os

from serve_vs_vllm import cpu_seconds

from fleetserve.loadtest.local_server import free_port
from fleetserve.loadtest.datasets import RequestSpec
from fleetserve.loadtest.runner import BenchConfig, run_benchmark
from fleetserve.platform.config import parse_config

# The groups that are the path in front of an engine (the load tester and Ray's control plane are not).
FRONT_END = ("Serve HTTP proxy", "ingress replica (FastAPI)", "engine replica (AsyncLLM front-end)", "metrics hub")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--num-requests", type=int, default=4, help="requests per concurrent stream")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE set before Ray starts")
    parser.add_argument("--serve-defaults", action="store_true",
                        help="Serve's default options instead of its fast path (server.serve_fast_path: false)")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="milliseconds between a request's tokens: 0 streams them as fast as the path takes "
                             "them (coalesced, many per Ray item); an engine's step time gives one per item")
    args = parser.parse_args()
    # Serve reads its options from the environment when its modules load, in every process Ray starts.
    os.environ.update(dict(item.split("=", 1) for item in args.env))
    label = ("Serve's defaults" if args.serve_defaults else "fast path") + "".join(f", {item}" for item in args.env) \
        + (f", a token every {args.step_ms:g} ms" if args.step_ms else "")

    import ray
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.deployments.serve_options import job_runtime_env
    from fleetserve.platform.instant_engine import InstantEngine

    config = parse_config({"models": [{"name": "instant", "source": "tiny-random-llama",
                                       "resources": {"num_cpus": 0.1}}],
                           "server": {"serve_fast_path": not args.serve_defaults}})
    # As `fleetserve serve` starts its cluster with this config, so the proxy runs as it would there.
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env=job_runtime_env(config.server))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine_cls = InstantEngine.paced(args.step_ms / 1000) if args.step_ms else InstantEngine
    serve.run(build_app(config, engine_cls=engine_cls), name="fleetserve", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    print(f"\nServe options: {label}\n")
    print("| concurrency | streamed tokens/s | front-end cores used | tokens/s per front-end core | "
          + " | ".join(f"{group} (CPU ms/token)" for group in FRONT_END) + " |")
    print("|---" * (4 + len(FRONT_END)) + "|")
    try:
        for concurrency in (int(part) for part in args.concurrency.split(",")):
            bench = BenchConfig(base_url=url, model="instant", request_rate=math.inf, max_concurrency=concurrency,
                                num_warmups=4, percentiles=[50, 99])
            before = cpu_seconds()
            result = asyncio.run(run_benchmark(bench, [RequestSpec("x", 1, args.tokens)]
                                               * (concurrency * args.num_requests)))
            after = cpu_seconds()
            metrics = result.metrics
            if metrics["failed"]:
                raise RuntimeError(f"{metrics['failed']} requests failed at concurrency {concurrency}")
            tokens, duration = metrics["total_output_tokens"], metrics["duration"]
            used = {group: after.get(group, 0.0) - before.get(group, 0.0) for group in FRONT_END}
            cores = sum(used.values()) / duration
            rate = tokens / duration
            print(f"| {concurrency} | {rate:.0f} | {cores:.2f} | {rate / cores:.0f} | "
                  + " | ".join(f"{1000 * used[group] / tokens:.3f}" for group in FRONT_END) + " |", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
