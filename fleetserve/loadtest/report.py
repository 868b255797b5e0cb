"""Benchmark output: the summary table, the result file, plots, and side-by-side comparison."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from fleetserve.loadtest.runner import RunResult

# Bump on any incompatible change to the result file; documented in docs/bench.md.
SCHEMA_VERSION = 1
_HEADLINE = [("completed", "Successful requests", "{:.0f}"), ("failed", "Failed requests", "{:.0f}"),
             ("refused", "  of which refused (429/503)", "{:.0f}"),
             ("refused_with_retry_after", "  refused with Retry-After", "{:.0f}"),
             ("duration", "Benchmark duration (s)", "{:.2f}"), ("total_input_tokens", "Total input tokens", "{:.0f}"),
             ("total_output_tokens", "Total generated tokens", "{:.0f}"),
             ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
             ("request_goodput", "Request goodput (req/s)", "{:.2f}"),
             ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
             ("total_token_throughput", "Total token throughput (tok/s)", "{:.2f}"),
             ("prefix_cache_hit_rate", "Prefix cache hit rate (server)", "{:.3f}")]
_LATENCY = [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
            ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"),
            ("refusal", "Time to Refusal (429/503)")]


def summary_table(result: RunResult) -> Table:
    config = result.config
    title = f"fleetserve bench: {config.model} @ {config.schedule}" + (" (interrupted)" if result.interrupted else "")
    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    metrics = result.metrics
    for key, label, fmt in _HEADLINE:
        if metrics.get(key) is not None:
            table.add_row(label, fmt.format(metrics[key]))
    for name, label in _LATENCY:
        if name == "refusal" and not metrics["refused"]:
            continue
        table.add_section()
        table.add_row(f"[bold]{label}[/]", "")
        for key in [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + \
                   [f"p{p:g}_{name}_ms" for p in config.percentiles]:
            table.add_row(f"  {key.split('_')[0].capitalize()} {name.upper()} (ms)", f"{metrics[key]:.2f}")
    return table


def save_results(path: Path, results: Sequence[RunResult], detailed: bool) -> None:
    document = {"schema_version": SCHEMA_VERSION, "tool": "fleetserve bench",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "runs": [result.to_dict(detailed) for result in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))


def load_results(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read result file {path}: {error}") from None
    if not isinstance(document, dict) or document.get("schema_version") != SCHEMA_VERSION or "runs" not in document:
        raise ValueError(f"{path} is not a fleetserve bench result (schema_version {SCHEMA_VERSION})")
    return document


def _label(path: Path, run: dict[str, Any], num_runs: int) -> str:
    return path.stem if num_runs == 1 else f"{path.stem}@{run['config']['request_rate']}"


COMPARE_KEYS = ["completed", "failed", "request_throughput", "output_throughput", "request_goodput",
                "prefix_cache_hit_rate",
                "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                "median_e2el_ms", "p99_e2el_ms"]


def compare_table(paths: Sequence[Path]) -> Table:
    """Figures of every run in ``paths`` side by side, with each run's ratio to the first."""
    columns: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        document = load_results(path)
        for run in document["runs"]:
            columns.append((_label(Path(path), run, len(document["runs"])), run["metrics"]))
    table = Table(title="fleetserve bench compare (ratio = run / first run)")
    table.add_column("metric")
    for index, (label, _) in enumerate(columns):
        table.add_column(label, justify="right")
        if index:
            table.add_column("ratio", justify="right")
    base = columns[0][1]
    for key in COMPARE_KEYS:
        if all(metrics.get(key) is None for _, metrics in columns):
            continue
        row = [key]
        for index, (_, metrics) in enumerate(columns):
            value = metrics.get(key)
            row.append("-" if value is None else f"{value:.2f}")
            if index:
                reference = base.get(key)
                row.append(f"{value / reference:.2f}x" if value is not None and reference else "-")
        table.add_row(*row)
    return table


def plot_run(result: RunResult, directory: Path, name: str) -> list[Path]:
    """TTFT and ITL distributions, and throughput and in-flight requests over time, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fleetserve.loadtest.metrics import timeline

    directory.mkdir(parents=True, exist_ok=True)
    done = [record for record in result.records if record.ok]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, values, label in ((axes[0], [r.ttft * 1000 for r in done if r.ttft is not None], "TTFT (ms)"),
                                (axes[1], [gap * 1000 for r in done for gap in r.itl], "ITL (ms)")):
        axis.hist(values or [0], bins=40, color="tab:blue", alpha=0.8)
        for percentile, style in ((50, "--"), (99, ":")):
            if values:
                mark = float(np.percentile(values, percentile))  # the table's method, so the numbers agree
                axis.axvline(mark, color="black", linestyle=style, label=f"p{percentile} {mark:.1f}")
        axis.set_xlabel(label)
        axis.set_ylabel("count")
        axis.legend()
    figure.suptitle(f"{result.config.model}: latency distributions ({len(done)} requests)")
    figure.tight_layout()
    distributions = directory / f"{name}-distributions.png"
    figure.savefig(distributions, dpi=110)
    plt.close(figure)

    horizon = max((record.start + (record.e2el or 0.0) for record in result.records), default=1.0)
    series = timeline(result.records, bucket_s=max(0.1, round(horizon / 100, 1)))
    figure, axes = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
    axes[0].step(series["time_s"], series["output_tokens_per_s"], where="post", color="tab:green")
    axes[0].set_ylabel("output tok/s")
    axes[1].step(series["time_s"], series["requests_in_flight"], where="post", color="tab:orange")
    axes[1].set_ylabel("requests in flight")
    axes[1].set_xlabel("time since start (s)")
    figure.suptitle(f"{result.config.model}: throughput and concurrency over time")
    figure.tight_layout()
    timeline_path = directory / f"{name}-timeline.png"
    figure.savefig(timeline_path, dpi=110)
    plt.close(figure)
    return [distributions, timeline_path]


def plot_sweep(results: Sequence[RunResult], directory: Path) -> Path:
    """Latency versus output throughput, one point per request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    throughput = [result.metrics["output_throughput"] for result in results]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, metric in ((axes[0], "ttft"), (axes[1], "tpot")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            axis.plot(throughput, [result.metrics[f"{stat}_{metric}_ms"] for result in results], style,
                      label=f"{stat} {metric.upper()}")
        for result, x in zip(results, throughput, strict=True):
            rate = result.config.request_rate
            axis.annotate("inf" if math.isinf(rate) else f"{rate:g}/s", (x, result.metrics[f"median_{metric}_ms"]),
                          textcoords="offset points", xytext=(4, 4), fontsize=8)
        axis.set_xlabel("output throughput (tok/s)")
        axis.set_ylabel(f"{metric.upper()} (ms)")
        axis.legend()
    figure.suptitle(f"{results[0].config.model}: latency vs throughput across request rates")
    figure.tight_layout()
    path = directory / "sweep.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
