"""``fleetserve router``: train, calibrate and evaluate cost/quality routers offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import httpx
import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fleetserve.cli.errors import console, fail
from fleetserve.router.model.embedders import embed_cached, make_embedder
from fleetserve.router.model.evaluation import RouterEvaluation, evaluate_routers
from fleetserve.router.model.labeling import (
    ChatClient,
    ExactMatchScorer,
    JudgeScorer,
    LabelError,
    label,
    recorded_prompts,
    sample_prompts,
)
from fleetserve.router.model.quality_router import (
    ROUTER_KINDS,
    CheckpointError,
    CostQualityRouter,
    TrainingParams,
    load_router,
    random_router,
    train_router,
)
from fleetserve.router.model.routing_data import (
    SPLIT_BYS,
    CorrectnessTable,
    DataError,
    Split,
    SplitBy,
    data_sha256,
    load_training_data,
)

router_app = typer.Typer(help="Cost/quality model routers (RouteLLM-compatible): train, calibrate, eval.",
                         no_args_is_help=True)


def _split(data_path: Path, split: Split, by: SplitBy = "prompt"):
    if by not in SPLIT_BYS:
        raise fail(f"--split-by must be one of {', '.join(SPLIT_BYS)}, got {by!r}")
    try:
        data = load_training_data(data_path)
    except DataError as error:
        raise fail(str(error)) from None
    part = data.select(split, by=by)
    if not part.prompts:
        hint = " (all its prompts share one group: add a 'group' column)" if by == "group" else ""
        raise fail(f"{data_path}: no prompts fall in the {split} split by {by}{hint}")
    return part


def _split_by(router: CostQualityRouter) -> SplitBy:
    # Checkpoints from before the group split were all trained on the prompt split.
    return router.metadata.get("training", {}).get("split_by", "prompt")


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
    router: Annotated[str, typer.Option(help="mf, classifier, mlp, knn or random.")] = "mf",
    embedder: Annotated[Optional[str], typer.Option(help="minilm (offline MiniLM-L6-v2; the default), hashing (no "
                                                         "dependencies) or difficulty (hand-written features); "
                                                         "random reads no prompt and takes none.")] = None,
    split_by: Annotated[str, typer.Option(help="prompt: 60% of prompts by hash; group: 60% of groups "
                                               "(subjects) by hash, so eval sees unseen groups.")] = "prompt",
    threads: Annotated[int, typer.Option(help="Torch threads for embedding the training prompts.")] = 2,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Trains a router on the training split and saves a checkpoint."""
    if router not in ROUTER_KINDS:
        raise fail(f"unknown router {router!r}; expected one of {', '.join(ROUTER_KINDS)}")
    if router == "random" and embedder is not None:
        raise fail("--embedder does not apply to --router random, which never reads a prompt's embedding")
    part = _split(data, "train", split_by)
    try:
        encoder = None if router == "random" else make_embedder(embedder or "minilm", num_threads=threads)
    except ValueError as error:
        raise fail(str(error)) from None
    console.print(f"training {router} on {len(part.prompts)} prompts of {data} (train split)"
                  + (f", embedder {encoder.spec}" if encoder is not None else ""))
    embeddings = embed_cached(encoder, part.prompts) if encoder is not None else None
    info = {"data": str(data.resolve()), "data_sha256": data_sha256(data), "split": "train", "split_by": split_by,
            "format": "correctness" if isinstance(part, CorrectnessTable) else "battles"}
    try:
        trained = train_router(router, part, encoder, embeddings, TrainingParams(seed=seed), data_info=info)
    except ValueError as error:
        raise fail(str(error)) from None
    trained.save(out)
    loss = trained.metadata.get("metrics", {}).get("train_loss")
    console.print(f"saved {out} (models weakest first: {trained.models}; "
                  f"train loss {'—' if loss is None else f'{loss:.4f}'})")


@router_app.command()
def calibrate(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint folder from `fleetserve router train`.")],
    strong_fraction: Annotated[float, typer.Option(help="Share of reference prompts to send to the strong model.")],
    data: Annotated[Optional[Path], typer.Option(help="Reference data; default the checkpoint's training data.")] = None,
    records: Annotated[Optional[Path], typer.Option(help="Calibrate on recorded traffic instead "
                                                         "(model_routing.recording.directory, or one of its files).")] = None,
    route: Annotated[Optional[str], typer.Option(help="With --records: only this route's prompts.")] = None,
    threads: Annotated[int, typer.Option(help="Torch threads for embedding.")] = 2,
) -> None:
    """Finds the threshold that sends --strong-fraction of the reference prompts to the strong model.

    The reference is the calibration split of the training data, or with --records the prompts the
    platform actually routed, so the share holds on the traffic a route serves.
    """
    if not 0.0 <= strong_fraction <= 1.0:
        raise fail(f"--strong-fraction must be in [0, 1], got {strong_fraction}")
    if records is not None and data is not None:
        raise fail("give --data or --records, not both")
    if route is not None and records is None:
        raise fail("--route picks a route's prompts from --records; without them it would change nothing")
    router = _load(checkpoint, threads)
    if records is not None:
        try:
            prompts = recorded_prompts(records, route)
        except ValueError as error:
            raise fail(str(error)) from None
        if not prompts:
            raise fail(f"{records}: no recorded prompts" + (f" for route {route!r}" if route else ""))
        reference = {"reference": str(records), "split": "recorded traffic", "route": route}
        what = "recorded prompts"
    else:
        data = data or Path(router.metadata.get("training", {}).get("data", ""))
        prompts = _split(data, "calibration", _split_by(router)).prompts
        reference = {"reference": str(data), "reference_sha256": data_sha256(data), "split": "calibration"}
        what = "calibration prompts"
    entry = router.calibrate(prompts, strong_fraction, embeddings=_embeddings(router, prompts), reference=reference)
    threshold, achieved = entry["threshold"], entry["achieved_fraction"]
    router.save(checkpoint)
    console.print(f"threshold {threshold:.6f} sends {achieved:.1%} of {len(prompts)} {what} "
                  f"to {router.strong}; saved in {checkpoint / 'metadata.json'}")
    typer.echo(f"{threshold:.6f}")


@router_app.command("label")
def label_traffic(
    records: Annotated[Path, typer.Argument(help="Recorded traffic (model_routing.recording.directory, or one of its files).")],
    url: Annotated[str, typer.Option(help="The platform's URL, e.g. http://127.0.0.1:8000.")],
    models: Annotated[str, typer.Option(help="The two served models to compare, cheap first: 'tiny,smollm2'.")],
    out: Annotated[Path, typer.Option(help="Battles JSONL to write (RouteLLM's format).")],
    scorer: Annotated[str, typer.Option(help="exact (needs --answers) or judge (needs --judge-model).")] = "exact",
    answers: Annotated[Optional[Path], typer.Option(help="JSONL of {prompt, answer} for the exact scorer.")] = None,
    judge_model: Annotated[Optional[str], typer.Option(help="Served model that judges, for the judge scorer.")] = None,
    route: Annotated[Optional[str], typer.Option(help="Only prompts routed through this route.")] = None,
    num_prompts: Annotated[int, typer.Option(help="Prompts to sample from the records.")] = 200,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    max_tokens: Annotated[int, typer.Option(help="Output budget per answer.")] = 64,
    api_key: Annotated[Optional[str], typer.Option(envvar="FLEETSERVE_API_KEY", help="Bearer key when auth is on.")] = None,
) -> None:
    """Turns recorded prompts into battles: each goes to both models, and a scorer picks the winner."""
    names = [name.strip() for name in models.split(",") if name.strip()]
    if len(names) != 2 or names[0] == names[1]:
        raise fail(f"--models needs two different served models, cheap first; got {models!r}")
    exact = None
    if scorer == "exact":
        if answers is None:
            raise fail("the exact scorer needs --answers (JSONL of prompt and answer)")
        try:
            exact = ExactMatchScorer.from_jsonl(answers)
        except (OSError, LabelError) as error:
            raise fail(str(error)) from None
    elif scorer == "judge":
        if judge_model is None:
            raise fail("the judge scorer needs --judge-model (a served model)")
    else:
        raise fail(f"unknown scorer {scorer!r}; expected exact or judge")
    try:
        prompts = recorded_prompts(records, route)
    except ValueError as error:
        raise fail(str(error)) from None
    if exact is not None:
        prompts = [p for p in prompts if p in exact.answers]  # no calls for prompts it cannot score
    sample = sample_prompts(prompts, num_prompts, seed)
    if not sample:
        raise fail(f"{records}: no recorded prompts to label" + (" with known answers" if scorer == "exact" else ""))
    console.print(f"labelling {len(sample)} of {len(prompts)} recorded prompts: {names[0]} vs {names[1]}, "
                  f"scorer {scorer}")
    client = ChatClient(url, api_key, max_tokens)
    chosen_scorer = exact if exact is not None else JudgeScorer(client, judge_model)
    with Progress(console=console) as progress:
        task = progress.add_task("battles", total=len(sample))
        try:
            battles, skipped = label(sample, client, names[0], names[1], chosen_scorer,
                                     on_step=lambda: progress.advance(task))
        except (LabelError, httpx.HTTPError) as error:
            raise fail(f"labelling stopped: {error}") from None
        finally:
            client.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(battle.to_json() + "\n" for battle in battles))
    counts = {winner: sum(b.winner == winner for b in battles) for winner in ("model_a", "model_b", "tie", "tie (bothbad)")}
    unparsed = getattr(chosen_scorer, "num_unparsed", 0)
    console.print(f"wrote {len(battles)} battles to {out} ({counts}; {skipped} skipped"
                  + (f"; {unparsed} judge verdicts unreadable, counted as ties" if unparsed else "") + ")")


def _table(evaluations: list[RouterEvaluation], split_by: SplitBy, out_of_domain: dict[str, float]) -> Table:
    unit = "groups" if split_by == "group" else "prompts"
    table = Table(title=f"held-out test split by {split_by} ({evaluations[0].num_prompts} prompts), "
                        f"95% bootstrap CIs over {unit}")
    for column in ("router", "APGR", "APGR − random", "CPT(50%)", "CPT(80%)", "out of domain"):
        table.add_column(column, justify="right" if column != "router" else "left")
    for ev in evaluations:
        flagged = out_of_domain.get(ev.router)
        table.add_row(ev.router, str(ev.apgr), str(ev.apgr_over_random) if ev.apgr_over_random else "—",
                      str(ev.cpt50), str(ev.cpt80), "—" if flagged is None else f"{flagged:.1%}")
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
    """Compares routers with the random router on the held-out test split: APGR, CPT(50%), CPT(80%).

    The split is the one the checkpoints were trained on (by prompt, or by group), so the test
    prompts are never ones they saw; checkpoints trained on different splits cannot be compared.
    """
    routers = [_load(path, threads) for path in checkpoint]
    split_bys = {path.name: _split_by(router) for path, router in zip(checkpoint, routers)}
    if len(set(split_bys.values())) > 1:
        raise fail(f"the checkpoints were trained on different splits ({split_bys}); the test split of one "
                   f"holds the training prompts of another")
    split_by = _split_by(routers[0])
    part = _split(data, "test", split_by)
    if not isinstance(part, CorrectnessTable):
        raise fail("eval needs per-prompt correctness CSVs (battles have no ground truth per model)")
    weak, strong = routers[0].weak, routers[0].strong
    for path, router in zip(checkpoint, routers):
        if (router.weak, router.strong) != (weak, strong) or weak not in part.models or strong not in part.models:
            raise fail(f"{path}: routes {router.weak} -> {router.strong}; expected {weak} -> {strong}, "
                        f"both columns of {data}")
    rates = {"random": random_router([weak, strong]).win_rates(part.prompts)}
    out_of_domain: dict[str, float] = {}
    for path, router in zip(checkpoint, routers):
        name = router.kind if router.kind not in rates else f"{router.kind} ({path.name})"
        embeddings = _embeddings(router, part.prompts)
        rates[name] = router.win_rates(part.prompts, embeddings=embeddings)
        if router.max_domain_distance is not None:
            distances = router.domain_distances(part.prompts, embeddings)
            out_of_domain[name] = float(np.mean(distances > router.max_domain_distance))
    console.print(f"bootstrapping {bootstrap} resamples of the {len(part.prompts)} test prompts "
                  f"({'by group' if split_by == 'group' else 'by prompt'}) ...")
    evaluations = evaluate_routers(rates, part.correct[:, part.models.index(weak)],
                                   part.correct[:, part.models.index(strong)], num_bootstrap=bootstrap,
                                   groups=part.groups if split_by == "group" else None)
    Console(width=140).print(_table(evaluations, split_by, out_of_domain))
    if plot is not None:
        plot_curves(evaluations, plot, f"{data.name}: {weak.split('/')[-1]} vs {strong.split('/')[-1]}")
        console.print(f"plot: {plot}")
    if json_out is not None:
        figures = {ev.router: {"apgr": ev.apgr.__dict__, "cpt50": ev.cpt50.__dict__, "cpt80": ev.cpt80.__dict__,
                               "apgr_over_random": ev.apgr_over_random.__dict__ if ev.apgr_over_random else None,
                               "num_prompts": ev.num_prompts, "out_of_domain": out_of_domain.get(ev.router)}
                   for ev in evaluations}
        json_out.write_text(json.dumps({"data": str(data), "data_sha256": data_sha256(data), "split": "test",
                                        "split_by": split_by, "num_groups": len(set(part.groups)),
                                        "weak": weak, "strong": strong, "routers": figures}, indent=2) + "\n")
