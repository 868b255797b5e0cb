"""Which router to try on unseen subjects, chosen without looking at them: grouped cross-validation.

    .venv/bin/python benchmarks/router_cv.py [--data ../shared/data/routellm/mmlu] [--seeds 4] [--folds 5]

The group split's test subjects are what docs/router.md leads with; every look at them spends some of
their honesty. Candidates are therefore compared on the other subjects only (train and calibration of the
group split): each fold holds out whole subjects, trains on the rest, and scores APGR on the held-out
ones; folds are drawn ``--seeds`` times. Candidates: the shipped routers on difficulty features
(``fleetserve router train``'s own training), gradient-boosted trees and ridge regressions from
scikit-learn on the same features or with the hashing embedding beside them, and rank averages of two.
Prints each candidate's mean APGR, the folds' spread, and its mean gain over mlp/difficulty with that
gain's spread across folds (the comparison is paired: every candidate sees the same folds).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
from scipy.stats import rankdata
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.linear_model import Ridge
from sklearn.model_selection import GroupKFold
from sklearn.preprocessing import StandardScaler

from fleetserve.router.model.embedders import embed_cached, make_embedder
from fleetserve.router.model.evaluation import routing_curve
from fleetserve.router.model.quality_router import train_router
from fleetserve.router.model.routing_data import CorrectnessTable, group_split_of, load_training_data

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "routellm" / "mmlu"
BASELINE = "mlp/difficulty"
Scorer = Callable[[np.ndarray, np.ndarray], np.ndarray]


def development_subjects(data: CorrectnessTable) -> CorrectnessTable:
    """The prompts of every subject outside the group split's test split."""
    keep = [i for i, group in enumerate(data.groups) if group_split_of(group) != "test"]
    return CorrectnessTable([data.prompts[i] for i in keep], data.models, data.correct[keep],
                            [data.groups[i] for i in keep])


def candidates(dev: CorrectnessTable, features: dict[str, np.ndarray]) -> dict[str, Scorer]:
    """Each candidate as (train rows, test rows) -> a score per test row (higher: send to the strong model)."""
    weak, strong = dev.strength_order()
    weak_right, strong_right = (dev.correct[:, dev.models.index(m)] for m in (weak, strong))
    # The battle outcome for the strong model: 1 it alone is right, 0 the weak one alone, 0.5 a tie.
    outcome = np.where(weak_right == strong_right, 0.5, strong_right.astype(float))
    difficulty, hashing = features["difficulty"].astype(np.float64), features["hashing"].astype(np.float64)

    def shipped(kind: str) -> Scorer:
        def score(train: np.ndarray, test: np.ndarray) -> np.ndarray:
            table = CorrectnessTable([dev.prompts[i] for i in train], dev.models, dev.correct[train],
                                     [dev.groups[i] for i in train])
            router = train_router(kind, table, make_embedder("difficulty"), features["difficulty"][train])
            return router.win_rates([dev.prompts[i] for i in test], embeddings=features["difficulty"][test])
        return score

    def trees(train: np.ndarray, test: np.ndarray) -> np.ndarray:
        model = HistGradientBoostingRegressor(max_iter=200, learning_rate=0.05, max_leaf_nodes=15,
                                              min_samples_leaf=50, random_state=0)
        return model.fit(difficulty[train], outcome[train]).predict(difficulty[test])

    def ridge(with_hashing: bool) -> Scorer:
        def score(train: np.ndarray, test: np.ndarray) -> np.ndarray:
            scaler = StandardScaler().fit(difficulty[train])
            parts = [scaler.transform(difficulty)] + ([hashing] if with_hashing else [])
            x = np.hstack(parts)
            return Ridge(alpha=30.0).fit(x[train], outcome[train]).predict(x[test])
        return score

    def hashing_ridge(train: np.ndarray, test: np.ndarray) -> np.ndarray:
        return Ridge(alpha=30.0).fit(hashing[train], outcome[train]).predict(hashing[test])

    def rank_average(*scorers: Scorer) -> Scorer:
        return lambda train, test: sum(rankdata(s(train, test)) for s in scorers)

    mlp = shipped("mlp")
    return {BASELINE: mlp, "classifier/difficulty": shipped("classifier"), "trees/difficulty": trees,
            "ridge/difficulty": ridge(False), "ridge/difficulty+hashing": ridge(True), "ridge/hashing": hashing_ridge,
            "mlp/difficulty + trees/difficulty": rank_average(mlp, trees),
            "mlp/difficulty + ridge/hashing": rank_average(mlp, hashing_ridge)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--folds", type=int, default=5)
    args = parser.parse_args()
    dev = development_subjects(load_training_data(args.data))
    weak, strong = dev.strength_order()
    weak_right, strong_right = (dev.correct[:, dev.models.index(m)] for m in (weak, strong))
    groups = np.array(dev.groups)
    print(f"{len(dev.prompts)} prompts in {len(set(dev.groups))} subjects (the group split's test subjects left out)",
          flush=True)
    features = {spec: embed_cached(make_embedder(spec, num_threads=2), dev.prompts)
                for spec in ("difficulty", "hashing")}
    scorers = candidates(dev, features)
    scores: dict[str, list[float]] = {name: [] for name in scorers}
    for seed in range(args.seeds):
        splitter = GroupKFold(n_splits=args.folds, shuffle=True, random_state=seed)
        for train, test in splitter.split(dev.prompts, groups=groups):
            if strong_right[test].mean() <= weak_right[test].mean():
                continue  # no gap to recover: APGR is undefined on these subjects
            for name, score in scorers.items():
                rates = np.asarray(score(train, test), dtype=np.float64)
                scores[name].append(routing_curve(rates, weak_right[test], strong_right[test]).apgr())
        print(f"seed {seed}: {len(scores[BASELINE])} folds scored", flush=True)
    baseline = np.array(scores[BASELINE])
    for name, values in scores.items():
        gain = np.array(values) - baseline
        print(f"{name:36s} APGR {np.mean(values):.3f} (sd {np.std(values):.3f})   "
              f"vs {BASELINE}: {gain.mean():+.3f} (sd {gain.std():.3f}, n {len(values)})")


if __name__ == "__main__":
    main()
