"""Replica routers side by side on 2 replicas of SmolLM2: cache-aware, session, round-robin, Ray's default.

    .venv/bin/python benchmarks/routing.py [--num-prompts 96]

For each router the app is redeployed (same engines, same cores: one core per replica) and loaded
with `fleetserve bench`'s runner: shared-prefix workloads (768-token prefixes; 8 groups, which fit
in every replica's KV cache, and 24, which fit only when split between replicas), then a workload
with no shared prefix to show what the policy costs where there is nothing to reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

from fleetserve.loadtest.datasets import PromptMaker, random_dataset, shared_prefix_dataset
from fleetserve.loadtest.report import save_results
from fleetserve.loadtest.runner import BenchConfig, run_benchmark
from fleetserve.platform.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
# cache_aware_kv_events: cache_aware fed by the engines' KV cache events instead of its routed index.
POLICIES = ["cache_aware", "cache_aware_kv_events", "session", "round_robin", "power_of_two"]
PORT = 8041


def config(policy: str):
    return parse_config({"models": [{
        "name": "smollm2", "source": "smollm2-135m-instruct", "replicas": 2,
        "engine_args": {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * 2**20,
                        "max_num_batched_tokens": 512},
        "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]},
        "routing": ({"policy": "cache_aware", "prefix_source": "kv_events"} if policy == "cache_aware_kv_events"
                    else {"policy": policy})}]})


def workloads(num_prompts: int):
    from transformers import AutoTokenizer

    from fleetserve.platform.model_store import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source("smollm2-135m-instruct")))

    def shared(num_groups: int):
        return shared_prefix_dataset(num_prompts, num_groups=num_groups, prefix_len=768, suffix_len=32,
                                     output_len=16, maker=PromptMaker(tokenizer, random.Random(num_groups)))

    unique = random_dataset(num_prompts // 2, input_len=800, output_len=16, range_ratio=0.0, prefix_len=0,
                            maker=PromptMaker(tokenizer, random.Random(1)))
    # One replica's 256 MiB KV cache holds ~11.6k SmolLM2 tokens (23 KiB each): ~14 of these 800-token
    # prompts. 8 groups fit in every replica; 24 fit only if each replica keeps its own half.
    return {"shared-prefix-8-groups": shared(8), "shared-prefix-24-groups": shared(24), "no-shared-prefix": unique}


async def measure(specs, rate: float):
    bench = BenchConfig(base_url=f"http://127.0.0.1:{PORT}", model="smollm2", request_rate=rate, seed=0,
                        ignore_eos=True, percentiles=[50, 99], num_warmups=0)
    return await run_benchmark(bench, specs)


def main() -> None:
    import ray
    from ray import serve

    from fleetserve.deployments.builders import build_app

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--request-rate", type=float, default=1.5)
    parser.add_argument("--workloads", default="shared-prefix-8-groups,shared-prefix-24-groups,no-shared-prefix",
                        help="comma-separated subset of the workloads to run")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated subset of the routers to run (power_of_two is the baseline)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "routing")
    args = parser.parse_args()
    loads = {name: specs for name, specs in workloads(args.num_prompts).items() if name in args.workloads.split(",")}
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    rows = []
    try:
        for policy in [p for p in POLICIES if p in args.policies.split(",")]:
            print(f"{policy}: deploying", flush=True)
            serve.run(build_app(config(policy)), name="fleetserve", route_prefix="/")
            for name, specs in loads.items():
                # Session routing keys on the prompt's group: one "conversation" per prefix group.
                result = asyncio.run(measure(specs, args.request_rate))
                save_results(args.out / f"{policy}-{name}.json", [result], detailed=False)
                metrics = result.metrics
                rows.append((name, policy, metrics))
                print(f"  {name}: mean TTFT {metrics['mean_ttft_ms']:.0f} ms, hit rate "
                      f"{metrics['prefix_cache_hit_rate']:.3f}", flush=True)
            serve.delete("fleetserve")
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\n| workload | router | mean TTFT ms | p50 TTFT ms | p99 TTFT ms | output tok/s | engine prefix hit rate "
          "| mean TTFT vs Ray default |\n|---|---|---|---|---|---|---|---|")
    for name, policy, metrics in rows:
        default = next(m for n, p, m in rows if n == name and p == "power_of_two")
        print(f"| {name} | {policy} | {metrics['mean_ttft_ms']:.0f} | {metrics['median_ttft_ms']:.0f} "
              f"| {metrics['p99_ttft_ms']:.0f} | {metrics['output_throughput']:.1f} "
              f"| {metrics['prefix_cache_hit_rate']:.3f} | {metrics['mean_ttft_ms'] / default['mean_ttft_ms']:.2f} |")


if __name__ == "__main__":
    main()
