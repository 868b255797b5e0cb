"""Cost/quality routers on RouteLLM's MMLU data, in domain and on subjects they never saw.

    .venv/bin/python benchmarks/router_quality.py [--data ../shared/data/routellm/mmlu] [--out results/router]

For each split (``group``: whole MMLU subjects held out, the figure that says how a router does on
a platform's own traffic; ``prompt``: other prompts of the training subjects, RouteLLM's setting),
trains every router (mf, classifier, mlp, knn) on every embedder (MiniLM, hashing, difficulty
features; knn needs a normalised embedder) on the train split, calibrates a 30% strong share on the
calibration split, and evaluates on the test split against the random router: APGR and CPT with
1000 bootstrap resamples (of whole subjects on the group split), and the share of test prompts the
router flags as out of domain. Times ``RouteTable.choose`` with the domain check (embedding
included, cold LRU cache, one torch thread) on 500 test prompts. Writes a JSON summary, one curve
PNG per split, and (``--save-checkpoints``) the checkpoints that ``examples/routed.yaml`` serves.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from fleetserve.cli.router import plot_curves
from fleetserve.platform.config import ModelRoute, ModelRoutingConfig
from fleetserve.router.model.embedders import embed_cached, make_embedder
from fleetserve.router.model.evaluation import evaluate_routers, strong_fraction_at, threshold_for_strong_fraction
from fleetserve.router.model.quality_router import random_router, train_router
from fleetserve.router.model.routes import RouteTable
from fleetserve.router.model.routing_data import data_sha256, load_training_data

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "routellm" / "mmlu"
# Router kinds per embedder; knn measures cosine similarity, which hand-written features lack.
ROUTERS = {"minilm": ("mf", "classifier", "mlp", "knn"), "hashing": ("mf", "classifier", "mlp", "knn"),
           "difficulty": ("mf", "classifier", "mlp")}
# What --save-checkpoints writes (as `make router-checkpoints` does): the router `auto` serves, and mf.
SERVED = {"mlp/difficulty": "mmlu-mlp-difficulty", "mf/minilm": "mmlu-mf-minilm"}
# The router whose calibration is replayed on unseen subjects' traffic (calibration_drift).
DRIFT_ROUTER = "mlp/difficulty"
TARGET_STRONG_FRACTION = 0.3


def decision_latency(router, prompts: list[str]) -> dict[str, float]:
    """Milliseconds per routing decision through RouteTable.choose with the domain check (cold cache)."""
    config = ModelRoutingConfig(tiers=["weak", "strong"], routes=[ModelRoute(
        name="timed", router=router.kind, threshold=0.5, out_of_domain_tier="strong")])
    route = RouteTable(config, routers={router.kind: router}).resolve("timed")
    router.embedder.embed_one.cache_clear()
    RouteTable.choose(route, "warm-up prompt")
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        RouteTable.choose(route, prompt)
        times.append((time.perf_counter() - start) * 1e3)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99)),
            "max_ms": float(max(times))}


def calibration_drift(router, test, embeddings: np.ndarray, seed: int = 0) -> dict[str, float]:
    """The strong share a calibrated route serves on traffic it was not calibrated on, before and after
    recalibrating on recorded traffic.

    The traffic is the group split's test prompts (subjects the router never saw) in a seeded random
    order. Calibrated on its own calibration split, the route serves some share of that traffic; then
    calibrated on the first half as recorded (``fleetserve router calibrate --records``), it serves
    the second half.
    """
    order = np.random.default_rng(seed).permutation(len(test.prompts))
    rates = router.win_rates([test.prompts[i] for i in order], embeddings=embeddings[order])
    first, second = rates[: len(rates) // 2], rates[len(rates) // 2:]
    threshold = next(e["threshold"] for e in router.metadata["calibrations"]
                     if e["strong_fraction"] == TARGET_STRONG_FRACTION)
    recalibrated = threshold_for_strong_fraction(first, TARGET_STRONG_FRACTION)
    return {"target": TARGET_STRONG_FRACTION, "served_before": strong_fraction_at(second, threshold),
            "served_after_recalibration": strong_fraction_at(second, recalibrated),
            "num_recorded": len(first), "num_served": len(second)}


def run_split(data, split_by: str, embeddings: dict[str, np.ndarray], info: dict, bootstrap: int):
    """Trains, calibrates and evaluates every router on one split; returns the figures and the routers."""
    index = {prompt: i for i, prompt in enumerate(data.prompts)}
    train, calibration, test = (data.select(split, by=split_by) for split in ("train", "calibration", "test"))
    rows = {name: np.array([index[p] for p in part.prompts], dtype=np.int64)
            for name, part in (("train", train), ("calibration", calibration), ("test", test))}
    print(f"split by {split_by}: train {len(train.prompts)} prompts in {len(set(train.groups))} groups, "
          f"calibration {len(calibration.prompts)} in {len(set(calibration.groups))}, "
          f"test {len(test.prompts)} in {len(set(test.groups))}", flush=True)
    rates, routers, extra = {}, {}, {}
    for spec, kinds in ROUTERS.items():
        embedder = make_embedder(spec, num_threads=2)
        vectors = {part: embeddings[spec][rows[part]] for part in rows}
        for kind in kinds:
            name = f"{kind}/{spec}"
            started = time.perf_counter()
            router = train_router(kind, train, embedder, vectors["train"],
                                  data_info={**info, "split_by": split_by})
            entry = router.calibrate(calibration.prompts, 0.3, {"reference": info["data"], "split": "calibration"},
                                     embeddings=vectors["calibration"])
            rates[name] = router.win_rates(test.prompts, embeddings=vectors["test"])
            distances = router.domain_distances(test.prompts, vectors["test"])
            extra[name] = {"calibration_at_0.3": {**entry, "test_fraction": strong_fraction_at(rates[name],
                                                                                              entry["threshold"])},
                           "out_of_domain": float(np.mean(distances > router.max_domain_distance)),
                           "train_seconds": time.perf_counter() - started}
            routers[name] = router
            print(f"  {name}: trained in {extra[name]['train_seconds']:.1f} s, "
                  f"{extra[name]['out_of_domain']:.1%} of test prompts out of domain", flush=True)
    weak, strong = routers["mf/minilm"].weak, routers["mf/minilm"].strong
    rates = {"random": random_router([weak, strong]).win_rates(test.prompts), **rates}
    evaluations = evaluate_routers(rates, test.correct[:, test.models.index(weak)],
                                   test.correct[:, test.models.index(strong)], num_bootstrap=bootstrap,
                                   groups=test.groups if split_by == "group" else None)
    drift = None
    if split_by == "group":
        spec = DRIFT_ROUTER.split("/")[1]
        drift = calibration_drift(routers[DRIFT_ROUTER], test, embeddings[spec][rows["test"]])
        print(f"calibration drift of {DRIFT_ROUTER} on unseen subjects: {drift}", flush=True)
    return test, evaluations, routers, extra, drift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("results/router"))
    parser.add_argument("--save-checkpoints", type=Path, default=None)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--latency-prompts", type=int, default=500)
    args = parser.parse_args()
    data = load_training_data(args.data)
    info = {"data": str(args.data.resolve()), "data_sha256": data_sha256(args.data), "split": "train",
            "format": "correctness"}
    # Offline embedding may use both cores; serving embeds with one thread (timed below).
    embeddings = {spec: embed_cached(make_embedder(spec, num_threads=2), data.prompts) for spec in ROUTERS}
    summary = {"data_sha256": info["data_sha256"], "splits": {}}
    served_routers = {}
    for split_by in ("group", "prompt"):
        test, evaluations, routers, extra, drift = run_split(data, split_by, embeddings, info, args.bootstrap)
        weak, strong = routers["mf/minilm"].weak, routers["mf/minilm"].strong
        held_out = "unseen subjects" if split_by == "group" else "held-out prompts"
        plot_curves(evaluations, args.out / f"router-mmlu-{split_by}.png",
                    f"MMLU, {held_out} ({len(test.prompts)} prompts, {len(set(test.groups))} subjects): "
                    f"{weak.split('/')[-1]} vs {strong.split('/')[-1]}")
        summary["splits"][split_by] = {
            "num_test": len(test.prompts), "num_test_groups": len(set(test.groups)), "weak": weak, "strong": strong,
            "weak_accuracy": evaluations[0].curve.weak_quality, "strong_accuracy": evaluations[0].curve.strong_quality,
            "routers": {ev.router: {"apgr": ev.apgr.__dict__, "cpt50": ev.cpt50.__dict__, "cpt80": ev.cpt80.__dict__,
                                    "apgr_over_random": ev.apgr_over_random.__dict__ if ev.apgr_over_random else None,
                                    "num_resamples": ev.num_resamples, **extra.get(ev.router, {})}
                        for ev in evaluations}}
        if drift is not None:
            summary["calibration_drift"] = {"router": DRIFT_ROUTER, **drift}
        for ev in evaluations:
            print(f"{split_by:6s} {ev.router:22s} APGR {ev.apgr}  gain {ev.apgr_over_random}  CPT50 {ev.cpt50}")
        if split_by == "prompt":
            served_routers = routers
            latency = {}
            for name, router in routers.items():
                if name.endswith("minilm"):  # as served: one torch thread
                    router.embedder = make_embedder("minilm", num_threads=1)
                latency[name] = decision_latency(router, test.prompts[: args.latency_prompts])
                print(f"latency {name}: {latency[name]}", flush=True)
            summary["latency"] = latency
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router-mmlu.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.save_checkpoints is not None:
        for name, folder in SERVED.items():
            print(f"saved {served_routers[name].save(args.save_checkpoints / folder)}")


if __name__ == "__main__":
    main()
