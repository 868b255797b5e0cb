"""Prefill/decode disaggregation against colocated serving, on 2 engines of SmolLM2 (one core each).

    .venv/bin/python benchmarks/disaggregation.py [--num-prompts 60] [--request-rate 0.8]

Workload (one run of `fleetserve bench`'s runner per setup, same seed): short-prompt streams (64 tokens
in, 128 out) with long prompts (1536 in, 16 out) among them, one long for every four short, Poisson
arrivals. The long prompts' prefills are what interferes with the short streams' decoding.

Setups, each with the same two engines (cores 0 and 1):
  colocated-chunked    2 colocated replicas, chunked prefill on (512-token chunks)
  colocated-unchunked  2 colocated replicas, chunked prefill off
  1p1d                 1 prefill + 1 decode replica, every prompt prefilled remotely
  1p1d-min512          1 prefill + 1 decode, prompts under 512 tokens prefilled on the decode replica

Short streams are scored on ITL/TPOT (what interference hurts), long prompts on TTFT; goodput counts
requests meeting both SLOs. Results: results/disaggregation/*.json, a table on stdout, and
docs/images/disaggregation.png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

from fleetserve.loadtest.client import RequestRecord
from fleetserve.loadtest.datasets import PromptMaker, RequestSpec
from fleetserve.loadtest.metrics import compute_metrics
from fleetserve.loadtest.report import load_results, save_results
from fleetserve.loadtest.runner import BenchConfig, run_benchmark
from fleetserve.platform.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
PORT = 8043
MODEL = "smollm2"
SHORT, LONG = 0, 1
# SLOs for goodput (ms): the TTFT a user waits for a long prompt, and the per-token pace of a stream.
SLO = {"ttft": 4000.0, "tpot": 100.0}
ENGINE_ARGS = {"dtype": "bfloat16", "max_model_len": 4096, "kv_cache_memory_bytes": 256 * 2**20}
SETUPS = ["colocated-chunked", "colocated-unchunked", "1p1d", "1p1d-min512"]


def model_config(setup: str) -> dict:
    base = {"name": MODEL, "source": "smollm2-135m-instruct", "resources": {"num_cpus": 0.1}}
    if setup.startswith("colocated"):
        chunked = setup == "colocated-chunked"
        args = {**ENGINE_ARGS, "enable_chunked_prefill": chunked, "max_num_batched_tokens": 512 if chunked else 4096}
        return {**base, "replicas": 2, "engine_args": args,
                "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]}, "routing": {"policy": "least_loaded"}}
    return {**base, "engine_args": {**ENGINE_ARGS, "max_num_batched_tokens": 512}, "disaggregation": {
        "prefill": {"replicas": 1, "cpu_binding": ["0"], "engine_args": {"max_num_batched_tokens": 2048}},
        "decode": {"replicas": 1, "cpu_binding": ["1"]},
        "min_prompt_tokens": 512 if setup.endswith("min512") else 0}}


def workload(num_prompts: int) -> list[RequestSpec]:
    from transformers import AutoTokenizer

    from fleetserve.platform.model_store import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source("smollm2-135m-instruct")))
    maker = PromptMaker(tokenizer, random.Random(0))
    specs = []
    for index in range(num_prompts):
        if index % 5 == 4:
            specs.append(RequestSpec(maker.text(1536), 1536, 16, group_id=LONG))
        else:
            specs.append(RequestSpec(maker.text(64), 64, 128, group_id=SHORT))
    return specs


# An inter-token gap this long is a visible stall in a stream.
STALL_MS = 250


def class_metrics(records: list[RequestRecord], duration_s: float, group: int) -> dict:
    """Figures for one request class, plus the ITL tail: p99.9, the longest gap, and the share of stalls.

    ITL p99 alone misses prefill interference when stalls are rarer than 1 in 100 gaps (unchunked prefill
    stalls each running stream once per long prompt, for the whole prefill).
    """
    records = [record for record in records if record.group_id == group]
    metrics = compute_metrics(records, duration_s, [50, 99, 99.9], SLO)
    gaps = [gap * 1000 for record in records if record.ok for gap in record.itl]
    metrics["max_itl_ms"] = max(gaps, default=0.0)
    metrics["stall_share"] = sum(gap > STALL_MS for gap in gaps) / len(gaps) if gaps else 0.0
    return metrics


async def measure(specs: list[RequestSpec], rate: float):
    bench = BenchConfig(base_url=f"http://127.0.0.1:{PORT}", model=MODEL, request_rate=rate, seed=0,
                        ignore_eos=True, percentiles=[50, 99], goodput=SLO, num_warmups=0,
                        dataset={"name": "pd-interference", "short": "64 in / 128 out", "long": "1536 in / 16 out"})
    return await run_benchmark(bench, specs)


def saved_rows(out: Path, setups: list[str]) -> list[tuple[str, dict, dict, dict]]:
    """The table rows from a previous run's detailed results (``--replot``)."""
    from dataclasses import fields

    rows = []
    names = {f.name for f in fields(RequestRecord)}
    for setup in setups:
        run = load_results(out / f"{setup}.json")["runs"][0]
        records = [RequestRecord(**{k: v for k, v in item.items() if k in names}) for item in run["records"]]
        duration = run["metrics"]["duration"]
        rows.append((setup, class_metrics(records, duration, SHORT), class_metrics(records, duration, LONG),
                     run["metrics"]))
    return rows


def plot(rows: list[tuple[str, dict, dict, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, *_ in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("short streams: ITL (ms)", 1, "itl_ms", ["median", "p99", "p99.9", "max"]),
              ("long prompts: TTFT (ms)", 2, "ttft_ms", ["median", "p99"]),
              ("short streams: TTFT (ms)", 1, "ttft_ms", ["median", "p99"])]
    for axis, (title, index, key, stats) in zip(axes, panels):
        width = 0.8 / len(stats)
        for offset, stat in enumerate(stats):
            values = [row[index][f"{stat}_{key}"] or 0 for row in rows]
            axis.bar([x - 0.4 + width * (offset + 0.5) for x in range(len(rows))], values, width=width,
                     label="p50" if stat == "median" else stat)
        axis.set_xticks(list(range(len(rows))), names, rotation=20)
        axis.set_title(title)
        axis.legend()
    fig.suptitle("Prefill-decode interference: colocated vs disaggregated (SmolLM2, 2 CPU cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    import ray
    from ray import serve

    from fleetserve.deployments.builders import build_app

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--request-rate", type=float, default=0.8)
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of the setups")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "disaggregation")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "disaggregation.png")
    parser.add_argument("--replot", action="store_true", help="table and plot from the results in --out; no runs")
    args = parser.parse_args()
    if args.replot:
        report(saved_rows(args.out, args.setups.split(",")), args.plot)
        return
    specs = workload(args.num_prompts)
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    rows = []
    try:
        for setup in args.setups.split(","):
            print(f"{setup}: deploying", flush=True)
            serve.run(build_app(parse_config({"models": [model_config(setup)]})), name="fleetserve", route_prefix="/")
            result = asyncio.run(measure(specs, args.request_rate))
            save_results(args.out / f"{setup}.json", [result], detailed=True)
            duration = result.metrics["duration"]
            short, long = (class_metrics(result.records, duration, SHORT),
                           class_metrics(result.records, duration, LONG))
            rows.append((setup, short, long, result.metrics))
            print(f"  short ITL p50/p99/p99.9/max {short['median_itl_ms']:.0f}/{short['p99_itl_ms']:.0f}/"
                  f"{short['p99.9_itl_ms']:.0f}/{short['max_itl_ms']:.0f} ms, stalls {short['stall_share']:.3%}, long TTFT "
                  f"p50/p99 {long['median_ttft_ms']:.0f}/{long['p99_ttft_ms']:.0f} ms, "
                  f"failed {result.metrics['failed']}", flush=True)
            serve.delete("fleetserve")
    finally:
        serve.shutdown()
        ray.shutdown()
    report(rows, args.plot)


def report(rows: list[tuple[str, dict, dict, dict]], plot_path: Path) -> None:
    plot(rows, plot_path)
    base = rows[0]
    print(f"\n| setup | short ITL p50 / p99 / p99.9 / max ms | short ITL > {STALL_MS} ms | short TPOT p50 / p99 ms "
          "| short TTFT p50 / p99 ms | long TTFT p50 / p99 ms | output tok/s | goodput req/s "
          "| ITL p99.9 vs colocated-chunked | long TTFT p50 vs colocated-chunked |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for setup, short, long, overall in rows:
        print(f"| {setup} | {short['median_itl_ms']:.0f} / {short['p99_itl_ms']:.0f} / {short['p99.9_itl_ms']:.0f} "
              f"/ {short['max_itl_ms']:.0f} | {short['stall_share']:.2%} "
              f"| {short['median_tpot_ms']:.0f} / {short['p99_tpot_ms']:.0f} "
              f"| {short['median_ttft_ms']:.0f} / {short['p99_ttft_ms']:.0f} "
              f"| {long['median_ttft_ms']:.0f} / {long['p99_ttft_ms']:.0f} | {overall['output_throughput']:.1f} "
              f"| {overall['request_goodput']:.3f} | {short['p99.9_itl_ms'] / base[1]['p99.9_itl_ms']:.2f} "
              f"| {long['median_ttft_ms'] / base[2]['median_ttft_ms']:.2f} |")


if __name__ == "__main__":
    main()
