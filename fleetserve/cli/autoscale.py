"""``fleetserve autoscale simulate``: replay a trace against autoscaling policies, side by side."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from fleetserve.cli.errors import console, fail
from fleetserve.autoscaler.policies import make_policy
from fleetserve.platform.config import AutoscalingConfig, ConfigError, ReplicaProfile, parse_section
from fleetserve.autoscaler.simulator import SLO, SimResult, simulate
from fleetserve.autoscaler.traces import TraceRequest, from_bench, from_csv, synthetic

autoscale_app = typer.Typer(help="Autoscaling policies: simulate them on a trace before production.",
                            no_args_is_help=True)


def load_trace(spec: str, seed: int | None = None, rate_scale: float = 1.0) -> list[TraceRequest]:
    """A recorded trace CSV (timestamp, prompt tokens, output tokens), a bench result file (``fleetserve bench
    --save-detailed``) or a synthetic spec (see traces.synthetic) drawn with ``seed`` (None: 0);
    ``rate_scale`` speeds it up.

    Raises:
        ValueError: a seed for a recorded trace, which it would not change; a bad spec or rate.
    """
    path = Path(spec)
    recorded = path.suffix.lower() == ".csv" or path.exists()
    if recorded and seed is not None:
        raise ValueError(f"--seed draws synthetic traces only; {spec} is replayed as recorded: drop --seed")
    if path.suffix.lower() == ".csv":
        return from_csv(path, rate_scale)
    if path.exists():
        requests = from_bench(path)
    else:
        requests = synthetic(spec, seed or 0)
    if rate_scale <= 0:
        raise ValueError(f"--rate-scale must be positive, got {rate_scale:g}")
    return [TraceRequest(r.arrival_s / rate_scale, r.prompt_tokens, r.output_tokens) for r in requests]


def _block(path: Path) -> dict[str, Any]:
    """An ``autoscaling:`` block from a file holding just the block, or the block under an ``autoscaling`` key."""
    data = _yaml(path)
    return data["autoscaling"] if set(data) == {"autoscaling"} else data


def _autoscaling(block: dict[str, Any], path: Path, profile: ReplicaProfile) -> AutoscalingConfig:
    """A policy's validated block; a ``slo`` block without its own profile sizes the pool on ``profile``, the
    simulated replica's."""
    if block.get("policy") == "slo" and "profile" not in block:
        block = {**block, "profile": profile.model_dump()}
    return parse_section(AutoscalingConfig, block, str(path))


def _stated_slo(blocks: list[tuple[Path, dict[str, Any]]]) -> tuple[Path, AutoscalingConfig] | None:
    """The first ``slo`` policy, validated (its profile None where its block names none): its SLOs and
    profile are what the simulation judges by and simulates by default (a policy judged against targets, or
    run on a replica, other than those it was given is not the comparison its author asked for)."""
    for path, block in blocks:
        if block.get("policy") == "slo":
            config = _autoscaling(block, path, ReplicaProfile())
            return path, config if "profile" in block else config.model_copy(update={"profile": None})
    return None


def _replica_and_slo(stated: tuple[Path, AutoscalingConfig] | None, profile: Path | None, slo_ttft: float | None,
                     slo_tpot: float | None) -> tuple[ReplicaProfile, SLO, str]:
    """The simulated replica and the SLOs: the options where given, else the first slo policy's, else the
    built-in ones; and a line saying which."""
    path, config = stated if stated else (None, None)
    if profile is not None:
        replica, replica_from = parse_section(ReplicaProfile, _yaml(profile), str(profile)), str(profile)
    elif config is not None and config.profile is not None:
        replica, replica_from = config.profile, f"{path.name}'s profile"
    else:
        replica, replica_from = ReplicaProfile(), "the built-in profile"
    slo = SLO(slo_ttft if slo_ttft is not None else config.ttft_p99_s if config else SLO.ttft_s,
              slo_tpot if slo_tpot is not None else config.tpot_p99_s if config else SLO.tpot_s)
    options = [name for name, value in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot)) if value is not None]
    slo_from = " and ".join(options if len(options) == 2 else [path.name if path else "the defaults", *options])
    return replica, slo, f"replicas simulated with {replica_from}; SLOs TTFT {slo.ttft_s:g} s, TPOT " \
                         f"{slo.tpot_s:g} s (from {slo_from})"


def _warn_mismatch(path: Path, config: AutoscalingConfig, replica: ReplicaProfile, slo: SLO) -> None:
    """Says when an SLO policy plans for targets or a replica other than those it is simulated and judged on
    (legitimate, to see what a miscalibrated profile costs, but never silent)."""
    if config.policy != "slo":
        return
    if (config.ttft_p99_s, config.tpot_p99_s) != (slo.ttft_s, slo.tpot_s):
        console.print(f"[yellow]note: {path.name} targets TTFT {config.ttft_p99_s:g} s / TPOT "
                      f"{config.tpot_p99_s:g} s but is judged on {slo.ttft_s:g} s / {slo.tpot_s:g} s[/yellow]")
    differing = [name for name, value in config.profile.model_dump().items() if getattr(replica, name) != value]
    if differing:
        console.print(f"[yellow]note: {path.name} plans with a profile whose {', '.join(differing)} differ from "
                      f"the simulated replica's[/yellow]")


def _yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise fail(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise fail(f"{path}: expected a mapping")
    return data


def results_table(results: list[SimResult], slo: SLO) -> Table:
    table = Table(title=f"SLO: TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1000:g} ms")
    columns = ["policy", "TTFT SLO", "TPOT SLO", "both", "replica-seconds", "vs first", "p50 TTFT", "p99 TTFT",
               "max replicas"]
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    base = results[0].replica_seconds
    for result in results:
        summary = result.summary()
        table.add_row(result.policy, f"{result.ttft_attainment:.2%}", f"{result.tpot_attainment:.2%}",
                      f"{result.slo_attainment:.2%}", f"{result.replica_seconds:,.0f}",
                      f"{result.replica_seconds / base:.2f}x", f"{summary['p50_ttft_s']:.2f} s",
                      f"{summary['p99_ttft_s']:.2f} s", str(summary["max_replicas"]))
    return table


def plot_timeline(results: list[SimResult], trace: list[TraceRequest], path: Path, title: str) -> None:
    """Arrival rate, replicas, KV usage, queue, TTFT and the share of arrivals that missed a target over time,
    one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(6, 1, figsize=(10, 13), sharex=True)
    arrivals = np.array([r.arrival_s for r in trace])
    horizon = max(p.time_s for result in results for p in result.timeline)
    bins = np.arange(0, horizon + 10, 10)
    counts, _ = np.histogram(arrivals, bins)
    axes[0].step(bins[:-1], counts / 10, where="post", color="black")
    axes[0].set_ylabel("arrivals (req/s)")
    # Requests and work can move apart (a few long prompts, many short ones): show both.
    prompt_tokens, _ = np.histogram(arrivals, bins, weights=[r.prompt_tokens for r in trace])
    work = axes[0].twinx()
    work.step(bins[:-1], prompt_tokens / 10, where="post", color="tab:purple", alpha=0.7)
    work.set_ylabel("prompt tokens/s", color="tab:purple")
    for result in results:
        times = [p.time_s for p in result.timeline]
        axes[1].plot(times, [p.num_replicas for p in result.timeline], label=result.policy, drawstyle="steps-post")
        axes[2].plot(times, [p.mean_kv_usage for p in result.timeline], label=result.policy, linewidth=0.8)
        axes[3].plot(times, [p.num_queued for p in result.timeline], label=result.policy, linewidth=0.8)
        axes[4].plot(times, [p.ttft_s if p.ttft_s is not None else math.nan for p in result.timeline],
                     label=result.policy, linewidth=0.8)
        # Where the misses fall, against the replicas above: what the attainment figure does not show.
        axes[5].step(bins[:-1], 100 * result.miss_share(bins), where="post", label=result.policy, linewidth=0.8)
    for axis, label in zip(axes[1:], ["replicas", "mean KV usage", "queued requests", "median TTFT (s)",
                                      "missed an SLO (% of\narrivals per 10 s)"]):
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[4].set_yscale("log")
    axes[5].set_xlabel("time (s)")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[0].set_title(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


@autoscale_app.command("simulate")
def simulate_command(
    trace: Annotated[str, typer.Option(help="A recorded trace CSV (timestamp, prompt tokens, output tokens, as Azure's "
                                            "LLM inference traces), a `fleetserve bench --save-detailed` result, or "
                                            "ramp:DURATION:START:END, bursts:DURATION:BASE:BURST[:BURSTINESS], "
                                            "day:DURATION:TROUGH:PEAK.")],
    policy: Annotated[Path, typer.Option(help="A model's autoscaling block as YAML, exactly as the platform config takes "
                                              "it, e.g. {policy: kv_cache, target_high: 0.75, max_replicas: 8}.")],
    compare: Annotated[Optional[list[Path]], typer.Option(help="Another policy YAML to run on the same trace; "
                                                               "repeat for each.")] = None,
    profile: Annotated[Optional[Path], typer.Option(help="Replica profile YAML (ReplicaProfile fields); default: the "
                                                        "first slo policy's profile, else built-in.")] = None,
    slo_ttft: Annotated[Optional[float], typer.Option(help="TTFT target in seconds; default: the first slo policy's "
                                                           "ttft_p99_s, else 2.")] = None,
    slo_tpot: Annotated[Optional[float], typer.Option(help="TPOT target in seconds; default: the first slo policy's "
                                                           "tpot_p99_s, else 0.1.")] = None,
    initial_replicas: Annotated[int, typer.Option(help="Replicas at the start.")] = 1,
    plot: Annotated[Optional[Path], typer.Option(help="Write the timeline PNG here.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the summaries as JSON here.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for synthetic traces (default 0); refused with a "
                                                     "recorded one.")] = None,
    rate_scale: Annotated[float, typer.Option(help="Play the trace this many times faster (2 plays an hour in 30 "
                                                   "minutes), to load a given fleet.")] = 1.0,
) -> None:
    """Replays a trace against each policy and compares SLO attainment and replica-seconds."""
    try:
        requests = load_trace(trace, seed, rate_scale)
    except ValueError as error:
        raise fail(str(error)) from None
    if not requests:
        raise fail(f"trace {trace} has no requests")
    blocks = [(path, _block(path)) for path in [policy, *(compare or [])]]
    try:
        replica, slo, judged_by = _replica_and_slo(_stated_slo(blocks), profile, slo_ttft, slo_tpot)
    except ConfigError as error:
        raise fail(str(error)) from None
    console.print(judged_by)
    results = []
    for path, block in blocks:
        try:
            config = _autoscaling(block, path, replica)
            _warn_mismatch(path, config, replica, slo)
            policy_object = make_policy(config)
            console.print(f"simulating {path.stem} on {len(requests)} requests ...")
            results.append(simulate(requests, policy_object, replica, slo, initial_replicas, name=path.stem))
        except ValueError as error:  # ConfigError names its file and keys itself
            raise fail(str(error) if isinstance(error, ConfigError) else f"{path}: {error}") from None
    Console(width=140).print(results_table(results, slo))
    if plot is not None:
        plot_timeline(results, requests, plot, f"{trace} ({len(requests)} requests)")
        console.print(f"timeline: {plot}")
    if json_out is not None:
        json_out.write_text(json.dumps({"trace": trace, "slo": slo.__dict__, "profile": replica.model_dump(),
                                        "results": {r.policy: r.summary() for r in results}}, indent=2) + "\n")
