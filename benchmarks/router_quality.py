"""Cost/quality routers on RouteLLM's MMLU data: APGR and CPT on the held-out split, and decision latency.

    .venv/bin/python benchmarks/router_quality.py [--data ../shared/data/routellm/mmlu] [--out results/router]

Trains mf and classifier with the MiniLM and hashing embedders on the train split (60% by prompt
hash), evaluates on the test split (30%) against the random router with 1000 bootstrap resamples,
calibrates on the calibration split (10%), and times ``RouteTable.choose`` (embedding included, cold
LRU cache, one torch thread) on 500 test prompts. Writes a JSON summary, a curve PNG, and the
mf/minilm and classifier/hashing checkpoints (``--save-checkpoints``) that ``examples/routed.yaml`` serves.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from fleetserve.platform.config import ModelRoutingConfig
from fleetserve.cli.router import plot_curves
from fleetserve.router.model.embedders import embed_cached, make_embedder
from fleetserve.router.model.evaluation import evaluate_routers, strong_fraction_at
from fleetserve.router.model.routes import RouteTable
from fleetserve.router.model.quality_router import random_router, train_router
from fleetserve.router.model.routing_data import data_sha256, load_training_data

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "routellm" / "mmlu"


def decision_latency(router, prompts: list[str]) -> dict[str, float]:
    """Milliseconds per routing decision through RouteTable.choose, embedding included (cold cache)."""
    table = RouteTable(ModelRoutingConfig(tiers=["weak", "strong"]), routers={router.kind: router})
    route = table.resolve(f"router-{router.kind}-0.5")
    if router.embedder is not None:
        router.embedder.embed_one.cache_clear()
        RouteTable.choose(route, "warm-up prompt")
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        RouteTable.choose(route, prompt)
        times.append((time.perf_counter() - start) * 1e3)
    cached_start = time.perf_counter()
    RouteTable.choose(route, prompts[0])
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99)),
            "max_ms": float(max(times)), "cached_ms": (time.perf_counter() - cached_start) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("results/router"))
    parser.add_argument("--save-checkpoints", type=Path, default=None)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--latency-prompts", type=int, default=500)
    args = parser.parse_args()
    data = load_training_data(args.data)
    train, calibration, test = (data.select(split) for split in ("train", "calibration", "test"))
    print(f"{len(data.prompts)} prompts: train {len(train.prompts)}, calibration {len(calibration.prompts)}, "
          f"test {len(test.prompts)}")
    info = {"data": str(args.data.resolve()), "data_sha256": data_sha256(args.data), "split": "train",
            "format": "correctness"}
    rates: dict[str, np.ndarray] = {}
    latency: dict[str, dict[str, float]] = {}
    calibrations: dict[str, dict] = {}
    routers = {}
    for spec in ("minilm", "hashing"):
        # Offline embedding may use both cores; serving embeds with one thread (timed below).
        embedder = make_embedder(spec, num_threads=2)
        embeddings = {name: embed_cached(embedder, part.prompts)
                      for name, part in (("train", train), ("calibration", calibration), ("test", test))}
        for kind in ("mf", "classifier"):
            name = f"{kind}/{spec}"
            started = time.perf_counter()
            router = train_router(kind, train, embedder, embeddings["train"], data_info=info)
            print(f"trained {name} in {time.perf_counter() - started:.1f} s")
            entry = router.calibrate(calibration.prompts, 0.3, {"reference": str(args.data), "split": "calibration"},
                                     embeddings=embeddings["calibration"])
            test_rates = router.win_rates(test.prompts, embeddings=embeddings["test"])
            calibrations[name] = {**entry, "test_fraction": strong_fraction_at(test_rates, entry["threshold"])}
            rates[name] = test_rates
            routers[name] = router
    rates = {"random": random_router(routers["mf/minilm"].models).win_rates(test.prompts), **rates}
    weak, strong = routers["mf/minilm"].weak, routers["mf/minilm"].strong
    evaluations = evaluate_routers(rates, test.correct[:, test.models.index(weak)],
                                   test.correct[:, test.models.index(strong)], num_bootstrap=args.bootstrap)
    # Latency as served: one torch thread, a fresh process-wide embedder per spec.
    for name in ("mf/minilm", "classifier/minilm", "mf/hashing", "classifier/hashing"):
        router = routers[name]
        if router.embedder is not None and name.endswith("minilm"):
            router.embedder = make_embedder("minilm", num_threads=1)
        latency[name] = decision_latency(router, test.prompts[: args.latency_prompts])
        print(f"latency {name}: {latency[name]}")
    args.out.mkdir(parents=True, exist_ok=True)
    plot_curves(evaluations, args.out / "router-mmlu.png",
                f"MMLU held-out ({len(test.prompts)} prompts): {weak.split('/')[-1]} vs {strong.split('/')[-1]}")
    summary = {"data_sha256": info["data_sha256"], "num_test": len(test.prompts), "weak": weak, "strong": strong,
               "weak_accuracy": evaluations[0].curve.weak_quality, "strong_accuracy": evaluations[0].curve.strong_quality,
               "routers": {ev.router: {"apgr": ev.apgr.__dict__, "cpt50": ev.cpt50.__dict__, "cpt80": ev.cpt80.__dict__,
                                       "apgr_over_random": ev.apgr_over_random.__dict__ if ev.apgr_over_random else None}
                           for ev in evaluations},
               "calibration_at_0.3": calibrations, "latency": latency}
    (args.out / "router-mmlu.json").write_text(json.dumps(summary, indent=2) + "\n")
    for ev in evaluations:
        print(f"{ev.router:20s} APGR {ev.apgr}  gain {ev.apgr_over_random}  CPT50 {ev.cpt50}  CPT80 {ev.cpt80}")
    if args.save_checkpoints is not None:
        for name in ("mf/minilm", "classifier/hashing"):
            folder = routers[name].save(args.save_checkpoints / f"mmlu-{name.replace('/', '-')}")
            print(f"saved {folder}")


if __name__ == "__main__":
    main()
