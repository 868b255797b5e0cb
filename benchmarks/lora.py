"""LoRA adapters on 2 replicas: the cost of serving adapters against the base model, and adapter-aware
routing against Ray Serve's default router.

    .venv/bin/python benchmarks/lora.py [--model smollm2] [--adapter-counts 1,4,16] [--num-prompts 96]

One run deploys, in turn, on the same 2 replicas (one core each):
  * the base model alone, loaded with requests for the base;
  * for each adapter count N, the base with N random adapters (rank 8; max_loras 2 per engine step,
    max_cpu_loras 4 per engine), loaded with requests spread over the N adapters by Zipf popularity
    (exponent 1), once under fleetserve's cache-aware router (adapter affinity after the imbalance check)
    and once under Ray Serve's default router (power of two choices).
Each deployment is loaded twice with `fleetserve bench`'s runner and the same prompts: at a Poisson rate
(latency: TTFT, TPOT) and saturated (all requests queued, 16 in flight: throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from fleetserve.loadtest.datasets import PromptMaker, random_dataset
from fleetserve.loadtest.report import save_results
from fleetserve.loadtest.runner import BenchConfig, run_benchmark
from fleetserve.platform.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
PORT = 8043
MODELS = {
    "smollm2": {"source": "smollm2-135m-instruct",
                "engine_args": {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * 2**20,
                                "max_num_batched_tokens": 512}},
    "tiny": {"source": "tiny-random-llama",
             "engine_args": {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 64 * 2**20,
                             "extra": {"enforce_eager": True}}},
}
ROUTERS = {"fleetserve": "cache_aware", "ray-default": "power_of_two"}


def config(model: str, num_adapters: int, policy: str):
    lora = ({"adapters": [{"name": f"adapter-{i}", "source": f"random-lora:{i}"} for i in range(num_adapters)],
             "max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": 8} if num_adapters else None)
    return parse_config({"models": [{
        "name": "base", **MODELS[model], "replicas": 2, "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]},
        "routing": {"policy": policy}, "lora": lora}]})


async def measure(specs, names: list[str], rate: float, max_concurrency: int | None = None):
    bench = BenchConfig(base_url=f"http://127.0.0.1:{PORT}", model=",".join(names), model_zipf=1.0,
                        request_rate=rate, max_concurrency=max_concurrency, seed=0, ignore_eos=True,
                        percentiles=[50, 99])
    return await run_benchmark(bench, specs)


def row(entry: dict, base: dict) -> str:
    metrics, saturated = entry["metrics"], entry["saturated"]
    throughput = saturated["output_throughput"]
    return (f"| {entry['label']} | {entry['router']} | {metrics['median_ttft_ms']:.0f} | {metrics['p99_ttft_ms']:.0f} "
            f"| {metrics['median_tpot_ms']:.1f} | {metrics['p99_tpot_ms']:.1f} | {throughput:.1f} "
            f"| {throughput / base['saturated']['output_throughput']:.2f} "
            f"| {metrics['failed'] + saturated['failed']} |")


def main() -> None:
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.model_store import resolve_source

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--adapter-counts", default="1,4,16")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "lora")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source(MODELS[args.model]["source"])))
    specs = random_dataset(args.num_prompts, input_len=256, output_len=64, range_ratio=0.0, prefix_len=0,
                           maker=PromptMaker(tokenizer, random.Random(0)))
    runs = [("base", 0, "fleetserve")] + [(f"{n} adapters", n, router) for n in map(int, args.adapter_counts.split(","))
                                          for router in ROUTERS]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    results = []
    try:
        for label, num_adapters, router in runs:
            print(f"{label}, {router}: deploying", flush=True)
            serve.run(build_app(config(args.model, num_adapters, ROUTERS[router])), name="fleetserve",
                      route_prefix="/")
            names = [f"adapter-{i}" for i in range(num_adapters)] or ["base"]
            paced = asyncio.run(measure(specs, names, args.request_rate))
            saturated = asyncio.run(measure(specs, names, float("inf"), max_concurrency=16))
            save_results(args.out / f"{args.model}-{num_adapters}-{router}.json", [paced, saturated], detailed=False)
            metrics = paced.metrics
            results.append({"label": label, "num_adapters": num_adapters, "router": router, "metrics": metrics,
                            "saturated": saturated.metrics, "routing": paced.to_dict(detailed=False)["routing"]})
            print(f"  p50 TTFT {metrics['median_ttft_ms']:.0f} ms, p50 TPOT {metrics['median_tpot_ms']:.1f} ms, "
                  f"saturated {saturated.metrics['output_throughput']:.1f} output tok/s, "
                  f"{metrics['failed'] + saturated.metrics['failed']} failed", flush=True)
            serve.delete("fleetserve")
    finally:
        serve.shutdown()
        ray.shutdown()
    (args.out / f"{args.model}-summary.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.model}, 2 replicas, 256 in / 64 out, {args.num_prompts} requests; latency at "
          f"{args.request_rate}/s (Poisson), throughput saturated (16 in flight); adapters by Zipf(1) popularity\n")
    print("| served | router | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms | saturated output tok/s "
          "| vs base | failed |\n|---|---|---|---|---|---|---|---|---|")
    for entry in results:
        print(row(entry, results[0]))


if __name__ == "__main__":
    main()
