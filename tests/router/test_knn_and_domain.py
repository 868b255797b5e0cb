"""The kNN router's arithmetic, the domain bound, and routes that fall back out of domain."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleetserve.platform.config import ModelRoute, ModelRoutingConfig
from fleetserve.router.model.domain import DomainParams, fit_domain, nearest_distances
from fleetserve.router.model.knn import KnnParams
from fleetserve.router.model.quality_router import TrainingParams, train_router
from fleetserve.router.model.routes import RouteError, RouteReason, RouteTable
from fleetserve.router.model.routing_data import CorrectnessTable

# Three training prompts on the unit circle: the strong model loses p0, ties p1, wins p2.
TRAIN_VECTORS = {"p0": (1.0, 0.0), "p1": (0.8, 0.6), "p2": (0.0, 1.0)}
QUERY_VECTORS = {"near p0": (1.0, 0.0), "near p2": (0.0, 1.0), "far": (-1.0, 0.0)}


class FixedEmbedder:
    """Embeds the prompts above to their fixed vectors (L2-normalised, like MiniLM)."""

    spec = "fixed-2d"
    dim = 2
    normalized = True

    def __init__(self) -> None:
        self.vectors = {**TRAIN_VECTORS, **QUERY_VECTORS}

    def embed(self, texts, progress=False):
        return np.array([self.vectors[t] for t in texts], dtype=np.float32)

    def embed_one(self, text):
        return self.embed([text])[0]


def three_prompts() -> CorrectnessTable:
    # Columns weak, strong: p0 only weak right, p1 both right, p2 only strong right.
    correct = np.array([[True, False], [True, True], [False, True]])
    return CorrectnessTable(list(TRAIN_VECTORS), ["weak", "strong"], correct, ["g", "g", "g"])


def knn_router(k: int, temperature: float):
    params = TrainingParams(knn=KnnParams(k=k, temperature=temperature), domain=DomainParams(quantile=1.0))
    data = three_prompts()
    # Weak accuracy 2/3 = strong accuracy 2/3: the tie keeps the table's order, weak first.
    return train_router("knn", data, FixedEmbedder(), params=params)


def test_knn_win_rate_is_the_mean_outcome_of_the_nearest_prompts():
    router = knn_router(k=2, temperature=1e9)  # a huge temperature weighs both neighbours equally
    rates = router.win_rates(["near p0", "near p2"])
    # near p0: neighbours p0 (cos 1) and p1 (cos 0.8), strong outcomes 0 and 0.5 -> 0.25;
    # near p2: neighbours p2 (cos 1) and p1 (cos 0.6), outcomes 1 and 0.5 -> 0.75.
    assert rates.tolist() == pytest.approx([0.25, 0.75], abs=1e-9)


def test_knn_weighs_nearer_prompts_by_the_temperature():
    router = knn_router(k=2, temperature=0.05)
    # near p0: weights exp(0) for p0 and exp((0.8 - 1) / 0.05) = e^-4 for p1:
    # (0 * 1 + 0.5 * e^-4) / (1 + e^-4).
    expected = 0.5 * math.exp(-4) / (1 + math.exp(-4))
    assert router.win_rates(["near p0"])[0] == pytest.approx(expected, rel=1e-6)


def test_domain_bound_is_the_quantile_of_leave_one_out_distances():
    support = np.array([[0.0], [1.0], [3.0]])
    kept, domain = fit_domain(support, DomainParams(quantile=0.5))
    # Nearest other point: 0 -> 1 (1), 1 -> 0 (1), 3 -> 1 (2); the median of [1, 1, 2] is 1.
    assert kept.tolist() == [[0.0], [1.0], [3.0]] and domain == {"max_distance": 1.0, "quantile": 0.5,
                                                                   "num_support": 3}
    assert nearest_distances(np.array([[10.0], [0.5]]), kept).tolist() == [7.0, 0.5]


def test_domain_support_is_a_seeded_sample_when_training_is_larger():
    x = np.arange(100, dtype=np.float32)[:, None]
    first, _ = fit_domain(x, DomainParams(num_support=10, seed=3))
    again, _ = fit_domain(x, DomainParams(num_support=10, seed=3))
    assert len(first) == 10 and np.array_equal(first, again)


def route_table(router, out_of_domain_tier="strong"):
    config = ModelRoutingConfig(tiers=["cheap", "strong"], routes=[ModelRoute(
        name="auto", router="knn", threshold=0.5, out_of_domain_tier=out_of_domain_tier)])
    return RouteTable(config, routers={"knn": router})


def test_a_prompt_beyond_the_domain_bound_goes_to_the_fallback_tier():
    router = knn_router(k=2, temperature=1e9)
    # quantile 1.0: the bound is the largest leave-one-out distance, p2 -> p1: |(0,1) - (0.8,0.6)| = sqrt(0.8).
    assert router.max_domain_distance == pytest.approx(math.sqrt(0.8), rel=1e-6)
    route = route_table(router).resolve("auto")
    far = RouteTable.choose(route, "far")
    # "far" is (-1, 0): distance 2 to p0, sqrt(1.8^2 + 0.6^2) to p1, sqrt(2) to p2; nearest sqrt(2) > sqrt(0.8).
    assert (far.model, far.reason, far.win_rate) == ("strong", RouteReason.OUT_OF_DOMAIN, None)
    assert far.domain_distance == pytest.approx(math.sqrt(2), rel=1e-6)
    near = RouteTable.choose(route, "near p0")
    # Win rate 0.25 < 0.5: the cheap tier, with the distance (0: it is p0's own vector) reported.
    assert (near.model, near.reason) == ("cheap", RouteReason.BELOW_THRESHOLD)
    assert near.win_rate == pytest.approx(0.25) and near.domain_distance == pytest.approx(0.0, abs=1e-6)
    assert RouteTable.choose(route, "near p2").reason == RouteReason.STRONGEST_NEEDED


def test_a_route_without_fallback_trusts_the_win_rate_far_away():
    route = route_table(knn_router(k=2, temperature=1e9), out_of_domain_tier=None).resolve("auto")
    far = RouteTable.choose(route, "far")
    # far's neighbours are p2 (cos 0) and p1 (cos -0.8): outcomes 1 and 0.5 -> 0.75 >= 0.5.
    assert (far.model, far.reason, far.domain_distance) == ("strong", RouteReason.STRONGEST_NEEDED, None)


def test_fallback_needs_a_checkpoint_that_kept_its_training_inputs():
    router = knn_router(k=2, temperature=1e9)
    del router.weights["domain_support"]  # as in a checkpoint trained before the domain bound existed
    with pytest.raises(RouteError, match="out_of_domain_tier needs a checkpoint that keeps its training inputs"):
        route_table(router)


def test_knn_refuses_an_embedder_without_cosine_geometry():
    from fleetserve.router.model.embedders import make_embedder

    with pytest.raises(ValueError, match="knn measures cosine similarity and needs an L2-normalised embedder"):
        train_router("knn", three_prompts(), make_embedder("difficulty"))
