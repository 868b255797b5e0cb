"""The kNN router: a prompt's win rate is the outcome on the training prompts nearest to it.

Each training prompt keeps every model's share of points on it (a correct answer against a wrong
one wins; ties count half). A new prompt's win rate of model a over model b is
``0.5 + 0.5 * (points_a - points_b)`` averaged over its ``k`` nearest training prompts by cosine
similarity, weighted by ``exp((similarity - best) / temperature)`` so nearer prompts count more
and rates rarely tie. On correctness data with two models that is exactly the mean battle outcome
of the neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

@dataclass(frozen=True)
class KnnParams:
    """How many neighbours vote, and how sharply nearer ones outweigh the rest."""

    # Neighbours per prompt.
    k: int = 64
    # Softmax temperature over cosine similarity; smaller gives the nearest neighbours more weight.
    temperature: float = 0.05


def knn_weights(embeddings: np.ndarray, points: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays a kNN checkpoint keeps: the training embeddings and each model's points on them.

    Args:
        embeddings: L2-normalised training embeddings [num_prompts, dim].
        points: each model's share of points per prompt [num_prompts, num_models]; NaN (never
            played) counts as a tie.
    """
    return {"support": np.asarray(embeddings, dtype=np.float32),
            "points": np.nan_to_num(np.asarray(points, dtype=np.float32), nan=0.5)}


def knn_points(weights: dict[str, np.ndarray], embeddings: np.ndarray, params: KnnParams) -> np.ndarray:
    """Each model's weighted mean points over each prompt's neighbours, float64 [num_prompts, num_models].

    Batch-invariant: one matrix-vector product per prompt gives it the same similarities alone or in
    a batch, and a stable sort breaks similarity ties by training order.
    """
    support = np.ascontiguousarray(weights["support"], dtype=np.float32)
    points = weights["points"].astype(np.float64)
    k = min(params.k, len(support))
    rows = np.empty((len(embeddings), points.shape[1]))
    for i, x in enumerate(np.asarray(embeddings, dtype=np.float32)):
        similarity = (support @ x).astype(np.float64)
        nearest = np.argsort(-similarity, kind="stable")[:k]
        weight = np.exp((similarity[nearest] - similarity[nearest[0]]) / params.temperature)
        rows[i] = weight @ points[nearest] / weight.sum()
    return rows
