"""``fleetserve router``: train, calibrate and evaluate cost/quality routers offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from fleetserve.cli.errors import console, fail
from fleetserve.router.model.embedders import embed_cached, make_embedder
from fleetserve.router.model.evaluation import RouterEvaluation, evaluate_routers
from fleetserve.router.model.quality_router import (
    CheckpointError,
    CostQualityRouter,
    TrainingParams,
    load_router,
    random_router,
    train_router,
)
from fleetserve.router.model.routing_data import CorrectnessTable, DataError, Split, data_sha256, load_training_data

router_app = typer.Typer(help="Cost/quality model routers (RouteLLM-compatible): train, calibrate, eval.",
                         no_args_is_help=True)


def _split(data_path: Path, split: Split):
    try:
        data = load_training_data(data_path)
    except DataError as error:
        raise fail(str(error)) from None
    part = data.select(split)
    if not part.prompts:
        raise fail(f"{data_path}: no prompts fall in the {split} split")
    return part


def _embeddings(router: CostQualityRouter, prompts: list[str]) -> np.ndarray | None:
    if router.embedder is None:
        return None
    return embed_cached(router.embedder, prompts)


def _load(checkpoint: Path, threads: int) -> CostQualityRouter:
    try:
        return load_router(checkpoint, num_threads=threads)
    except (CheckpointError, ValueError) as error:
        raise fail(f"cannot load router checkpoint {checkpoint}: {error}") from None


@router_app.command()
def train(
    data: Annotated[Path, typer.Argument(help="Correctness CSV(s) (a file or folder) or battles JSONL.")],
    out: Annotated[Path, typer.Option(help="Checkpoint folder to write.")],
    router: Annotated[str, typer.Option(help="mf, classifier or random.")] = "mf",
    embedder: Annotated[str, typer.Option(help="minilm (offline MiniLM-L6-v2) or hashing (no dependencies).")] = "minilm",
    threads: Annotated[int, typer.Option(help="Torch threads for embedding the training prompts.")] = 2,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Trains a router on the training split (60% of prompts, by hash) and saves a checkpoint."""
    if router not in ("mf", "classifier", "random"):
        raise fail(f"unknown router {router!r}; expected mf, classifier or random")
    part = _split(data, "train")
    try:
        encoder = make_embedder(embedder, num_threads=threads)
    except ValueError as error:
        raise fail(str(error)) from None
    console.print(f"training {router} on {len(part.prompts)} prompts of {data} (train split), embedder {encoder.spec}")
    embeddings = embed_cached(encoder, part.prompts) if router != "random" else None
    info = {"data": str(data.resolve()), "data_sha256": data_sha256(data), "split": "train",
            "format": "correctness" if isinstance(part, CorrectnessTable) else "battles"}
    trained = train_router(router, part, encoder, embeddings, TrainingParams(seed=seed), data_info=info)
    trained.save(out)
    console.print(f"saved {out} (models weakest first: {trained.models}; "
                  f"train loss {trained.metadata.get('metrics', {}).get('train_loss', float('nan')):.4f})")


@router_app.command()
def calibrate(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint folder from `fleetserve router train`.")],
    strong_fraction: Annotated[float, typer.Option(help="Share of reference prompts to send to the strong model.")],
    data: Annotated[Optional[Path], typer.Option(help="Reference data; default the checkpoint's training data.")] = None,
    threads: Annotated[int, typer.Option(help="Torch threads for embedding.")] = 2,
) -> None:
    """Finds the threshold that sends --strong-fraction of the calibration split to the strong model."""
    if not 0.0 <= strong_fraction <= 1.0:
        raise fail(f"--strong-fraction must be in [0, 1], got {strong_fraction}")
    router = _load(checkpoint, threads)
    data = data or Path(router.metadata.get("training", {}).get("data", ""))
    part = _split(data, "calibration")
    entry = router.calibrate(part.prompts, strong_fraction, embeddings=_embeddings(router, part.prompts),
                             reference={"reference": str(data), "reference_sha256": data_sha256(data),
                                        "split": "calibration"})
    threshold, achieved = entry["threshold"], entry["achieved_fraction"]
    router.save(checkpoint)
    console.print(f"threshold {threshold:.6f} sends {achieved:.1%} of {len(part.prompts)} calibration prompts "
                  f"to {router.strong}; saved in {checkpoint / 'metadata.json'}")
    typer.echo(f"{threshold:.6f}")


def _table(evaluations: list[RouterEvaluation]) -> Table:
    table = Table(title=f"held-out test split ({evaluations[0].num_prompts} prompts), 95% bootstrap CIs")
    for column in ("router", "APGR", "APGR − random", "CPT(50%)", "CPT(80%)"):
        table.add_column(column, justify="right" if column != "router" else "left")
    for ev in evaluations:
        table.add_row(ev.router, str(ev.apgr), str(ev.apgr_over_random) if ev.apgr_over_random else "—",
                      str(ev.cpt50), str(ev.cpt80))
    return table


def plot_curves(evaluations: list[RouterEvaluation], path: Path, title: str) -> None:
    """Quality against strong-call share, one line per router, with the all-weak and all-strong levels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for ev in evaluations:
        axis.plot(ev.curve.strong_fractions * 100, ev.curve.quality, label=f"{ev.router} (APGR {ev.apgr.value:.3f})")
    curve = evaluations[0].curve
    axis.axhline(curve.strong_quality, color="grey", linestyle="--", linewidth=1, label="strong only")
    axis.axhline(curve.weak_quality, color="grey", linestyle=":", linewidth=1, label="weak only")
    axis.set_xlabel("calls to the strong model (%)")
    axis.set_ylabel("accuracy")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


@router_app.command("eval")
def evaluate(
    data: Annotated[Path, typer.Argument(help="Correctness CSV(s); only the held-out test split is used.")],
    checkpoint: Annotated[list[Path], typer.Option(help="Checkpoint folder(s) to compare (repeatable).")],
    plot: Annotated[Optional[Path], typer.Option(help="Write the quality/strong-share curve here (PNG).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the figures as JSON here.")] = None,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples for the confidence intervals.")] = 1000,
    threads: Annotated[int, typer.Option(help="Torch threads for embedding.")] = 2,
) -> None:
    """Compares routers with the random router on the held-out test split: APGR, CPT(50%), CPT(80%)."""
    part = _split(data, "test")
    if not isinstance(part, CorrectnessTable):
        raise fail("eval needs per-prompt correctness CSVs (battles have no ground truth per model)")
    routers = [_load(path, threads) for path in checkpoint]
    weak, strong = routers[0].weak, routers[0].strong
    for path, router in zip(checkpoint, routers):
        if (router.weak, router.strong) != (weak, strong) or weak not in part.models or strong not in part.models:
            raise fail(f"{path}: routes {router.weak} -> {router.strong}; expected {weak} -> {strong}, "
                        f"both columns of {data}")
    rates = {"random": random_router([weak, strong]).win_rates(part.prompts)}
    for path, router in zip(checkpoint, routers):
        name = router.kind if router.kind not in rates else f"{router.kind} ({path.name})"
        rates[name] = router.win_rates(part.prompts, embeddings=_embeddings(router, part.prompts))
    console.print(f"bootstrapping {bootstrap} resamples of {len(part.prompts)} test prompts ...")
    evaluations = evaluate_routers(rates, part.correct[:, part.models.index(weak)],
                                   part.correct[:, part.models.index(strong)], num_bootstrap=bootstrap)
    Console(width=120).print(_table(evaluations))
    if plot is not None:
        plot_curves(evaluations, plot, f"{data.name}: {weak.split('/')[-1]} vs {strong.split('/')[-1]}")
        console.print(f"plot: {plot}")
    if json_out is not None:
        figures = {ev.router: {"apgr": ev.apgr.__dict__, "cpt50": ev.cpt50.__dict__, "cpt80": ev.cpt80.__dict__,
                               "apgr_over_random": ev.apgr_over_random.__dict__ if ev.apgr_over_random else None,
                               "num_prompts": ev.num_prompts} for ev in evaluations}
        json_out.write_text(json.dumps({"data": str(data), "data_sha256": data_sha256(data), "split": "test",
                                        "weak": weak, "strong": strong, "routers": figures}, indent=2) + "\n")
