"""Cost/quality routers: how likely is the strong model needed for this prompt?

The interface is RouteLLM's: ``strong_win_rate(prompt)`` is the predicted probability that the
strong model beats the weak one, and a request goes to the strong model when that rate is at or
above the threshold. Every router here scores each model per prompt (``scores``), so the win rate of
any pair is ``sigmoid(score_a - score_b)`` (Bradley-Terry) and routes may have more than two tiers.

* ``random``: a uniform draw per prompt (a hash, so the same prompt always gets the same rate).
* ``mf``: RouteLLM's matrix factorisation, ``score_m(x) = w . (normalize(P_m) * (W x))``.
* ``classifier``: logistic regression with one linear score per model, ``score_m(x) = w_m . x + b_m``.
* ``mlp``: one hidden layer to a score per model (``mlp.py``).
* ``knn``: the outcomes on the nearest training prompts (``knn.py``); rates are averaged outcomes,
  not a sigmoid of scores.

Inputs from an embedder that is not L2-normalised (``difficulty``) are standardised with the
training split's mean and deviation, kept in the checkpoint. Every trained router also keeps a
sample of its training inputs, so it can tell how far a prompt lies from them (``domain.py``).

Training uses pairwise battles (correctness tables become battles, ties counting half); inference
is numpy over the saved float32 arrays, so a loaded checkpoint reproduces win rates bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fleetserve.router.model.domain import DomainParams, fit_domain, nearest_distances, squared_norms
from fleetserve.router.model.embedders import Embedder, make_embedder
from fleetserve.router.model.evaluation import strong_fraction_at, threshold_for_strong_fraction
from fleetserve.router.model.knn import KnnParams, knn_points, knn_weights
from fleetserve.router.model.mlp import MlpParams, mlp_scores, train_mlp
from fleetserve.router.model.routing_data import Battles, CorrectnessTable, TrainingData

RouterKind = Literal["random", "mf", "classifier", "mlp", "knn"]
ROUTER_KINDS: tuple[RouterKind, ...] = ("random", "mf", "classifier", "mlp", "knn")
FORMAT_VERSION = 1
WEIGHTS_FILE = "weights.safetensors"
METADATA_FILE = "metadata.json"


class CheckpointError(ValueError):
    """A router checkpoint that cannot be loaded; the message says why."""


_BELOW_ONE = float(np.nextafter(1.0, 0.0))


def _sigmoid(x: np.ndarray | float) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


@dataclass
class CostQualityRouter:
    """A trained (or random) router over a fixed list of models, weakest first.

    Args:
        kind: which router.
        models: the models it scores, weakest first; the last is "strong" and the first "weak".
        embedder: turns prompts into the vectors the weights expect (unused by ``random``).
        weights: the arrays that define the scores (see the module docstring).
        metadata: what the checkpoint records about training, metrics and calibration.
    """

    kind: RouterKind
    models: list[str]
    embedder: Embedder | None = None
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    # squared_norms of weights["domain_support"], computed on the first distance asked for.
    _support_norms: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def strong(self) -> str:
        return self.models[-1]

    @property
    def weak(self) -> str:
        return self.models[0]

    def inputs(self, embeddings: np.ndarray) -> np.ndarray:
        """The router's inputs, float64: embeddings, standardised when the checkpoint says so."""
        x = np.asarray(embeddings, dtype=np.float64)
        if "input_mean" in self.weights:
            x = (x - self.weights["input_mean"].astype(np.float64)) / self.weights["input_std"].astype(np.float64)
        return x

    def scores(self, embeddings: np.ndarray) -> np.ndarray:
        """Per-model scores, float64 [num_prompts, num_models], from prompt embeddings.

        Batch-invariant: einsum's own loops (not BLAS, whose kernels differ between one row and
        many) give each prompt the same bits whether it is scored alone in serving or in a batch
        during calibration, so a prompt at a calibrated threshold routes the same way in both.
        """
        x = self.inputs(embeddings)
        if self.kind == "mlp":
            return mlp_scores(self.weights, x)
        if self.kind == "mf":
            projection = np.einsum("nd,kd->nk", x, self.weights["text_proj"].astype(np.float64), optimize=False)
            P = self.weights["P"].astype(np.float64)
            model_embeds = P / np.maximum(np.sqrt(np.einsum("mk,mk->m", P, P, optimize=False))[:, None], 1e-12)
            return np.einsum("nk,mk,k->nm", projection, model_embeds, self.weights["classifier"].astype(np.float64),
                             optimize=False)
        if self.kind == "classifier":
            return (np.einsum("nd,md->nm", x, self.weights["coef"].astype(np.float64), optimize=False)
                    + self.weights["bias"].astype(np.float64))
        raise ValueError(f"router {self.kind!r} has no scores")

    def _random_rates(self, prompts: list[str]) -> np.ndarray:
        seed = str(self.metadata.get("seed", 0))
        return np.array([int.from_bytes(hashlib.sha256(f"{seed}:{p}".encode()).digest()[:8], "big") / 2.0**64
                         for p in prompts])

    def win_rates(self, prompts: list[str], model_a: str | None = None, model_b: str | None = None,
                  embeddings: np.ndarray | None = None) -> np.ndarray:
        """P(model_a beats model_b) per prompt; by default the strong model over the weak one.

        Args:
            embeddings: the prompts' embeddings when already computed (evaluation reuses them).
        """
        a = self.models.index(model_a or self.strong)
        b = self.models.index(model_b or self.weak)
        if a == b:
            return np.full(len(prompts), 0.5)
        if self.kind == "random":
            rates = self._random_rates(prompts)
            return rates if a > b else 1.0 - rates
        if embeddings is None:
            embeddings = self.embedder.embed(prompts)
        if self.kind == "knn":
            points = knn_points(self.weights, self.inputs(embeddings), KnnParams(**self.metadata["knn"]))
            rates = 0.5 + 0.5 * (points[:, a] - points[:, b])
        else:
            scores = self.scores(embeddings)
            rates = _sigmoid(scores[:, a] - scores[:, b])
        # Below 1 so that threshold 1 routes everything to the weak model, as in RouteLLM.
        return np.minimum(rates, _BELOW_ONE)

    @property
    def max_domain_distance(self) -> float | None:
        """Beyond this distance from the training inputs a prompt is out of domain (None: no support kept)."""
        domain = self.metadata.get("domain")
        return float(domain["max_distance"]) if domain and "domain_support" in self.weights else None

    def domain_distances(self, prompts: list[str], embeddings: np.ndarray | None = None) -> np.ndarray:
        """Each prompt's distance to the nearest kept training input, in the router's input space."""
        if self.max_domain_distance is None:
            raise ValueError(f"the {self.kind} router keeps no training inputs to measure distance against")
        if embeddings is None:
            embeddings = self.embedder.embed(prompts)
        support = self.weights["domain_support"]
        if self._support_norms is None:
            self._support_norms = squared_norms(support)
        return nearest_distances(self.inputs(embeddings), support, support_norms=self._support_norms)

    def domain_distance(self, prompt: str) -> float:
        """One prompt's distance to the training inputs, with the embedding from the LRU cache."""
        return float(self.domain_distances([prompt], self.embedder.embed_one(prompt)[None, :])[0])

    def win_rate(self, prompt: str, model_a: str, model_b: str) -> float:
        """P(model_a beats model_b) on one prompt, with the embedding from the LRU cache."""
        if self.kind == "random":
            return float(self.win_rates([prompt], model_a, model_b)[0])
        embedding = self.embedder.embed_one(prompt)[None, :]
        return float(self.win_rates([prompt], model_a, model_b, embeddings=embedding)[0])

    def strong_win_rate(self, prompt: str) -> float:
        """RouteLLM's routing value: route to the strong model when this is >= the threshold."""
        return self.win_rate(prompt, self.strong, self.weak)

    def calibrate(self, prompts: list[str], strong_fraction: float, reference: dict[str, Any] | None = None,
                  embeddings: np.ndarray | None = None) -> dict[str, Any]:
        """Sets the threshold that sends ``strong_fraction`` of ``prompts`` to the strong model.

        The entry is kept in ``metadata["calibrations"]`` (replacing one for the same fraction), where
        routes configured with ``strong_fraction`` find it once the checkpoint is saved.

        Returns:
            The calibration entry: threshold, achieved fraction, reference provenance.
        """
        rates = self.win_rates(prompts, embeddings=embeddings)
        threshold = threshold_for_strong_fraction(rates, strong_fraction)
        entry = {"strong_fraction": strong_fraction, "threshold": threshold,
                 "achieved_fraction": strong_fraction_at(rates, threshold), "num_prompts": len(prompts),
                 **(reference or {})}
        kept = [e for e in self.metadata.get("calibrations", []) if abs(e["strong_fraction"] - strong_fraction) > 1e-9]
        self.metadata["calibrations"] = sorted([*kept, entry], key=lambda e: e["strong_fraction"])
        return entry

    def save(self, directory: str | Path) -> Path:
        """Writes ``weights.safetensors`` and ``metadata.json``; returns the folder."""
        from safetensors.numpy import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in self.weights.items()}
        if not arrays:  # safetensors needs one tensor; random keeps its seed
            arrays = {"seed": np.array([self.metadata.get("seed", 0)], dtype=np.float32)}
        save_file(arrays, str(directory / WEIGHTS_FILE))
        metadata = {**self.metadata, "format_version": FORMAT_VERSION, "router": self.kind, "models": self.models,
                    "strong": self.strong, "weak": self.weak,
                    "embedder": self.embedder.spec if self.embedder is not None else None}
        (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        return directory


def fetch_checkpoint(uri: str) -> Path:
    """A local copy of a checkpoint folder in object storage (s3://, gs://, az://), fetched once per version.

    Raises:
        CheckpointError: the store cannot be read, or the folder holds no checkpoint.
    """
    from fleetserve.platform.model_store import cache_root
    from fleetserve.platform.object_store import ObjectStoreError, snapshot

    try:
        return snapshot(uri, ("*",), METADATA_FILE, cache_root())
    except ObjectStoreError as error:
        raise CheckpointError(f"router checkpoint {error}") from None


def load_router(directory: str | Path, embedder: Embedder | None = None, num_threads: int = 1) -> CostQualityRouter:
    """Loads a checkpoint folder written by ``CostQualityRouter.save``, local or in object storage.

    Args:
        embedder: overrides the one named in the metadata (it must have the same spec).
        num_threads: torch threads of the embedder built from the metadata (1 in serving).

    Raises:
        CheckpointError: missing files, a newer format, or an embedder that does not match.
    """
    from safetensors.numpy import load_file

    from fleetserve.platform.object_store import is_object_store_uri

    directory = fetch_checkpoint(directory) if is_object_store_uri(str(directory)) else Path(directory)
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text())
        arrays = load_file(str(directory / WEIGHTS_FILE))
    except FileNotFoundError as error:
        raise CheckpointError(f"{directory}: not a router checkpoint ({Path(error.filename).name} is missing)") from None
    except (json.JSONDecodeError, OSError) as error:
        raise CheckpointError(f"{directory}: unreadable router checkpoint: {error}") from None
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: checkpoint format {version} is not {FORMAT_VERSION}; retrain it")
    kind = metadata["router"]
    if kind not in ROUTER_KINDS:
        raise CheckpointError(f"{directory}: unknown router kind {kind!r}")
    spec = metadata.get("embedder")
    if kind != "random":
        if embedder is None:
            embedder = make_embedder(spec, num_threads=num_threads)
        elif embedder.spec != spec:
            raise CheckpointError(f"{directory}: trained with embedder {spec!r}, not {embedder.spec!r}")
    weights = {} if kind == "random" else arrays
    return CostQualityRouter(kind, list(metadata["models"]), embedder, weights, metadata)


def random_router(models: list[str], seed: int = 0) -> CostQualityRouter:
    """The baseline: win rates uniform in [0, 1), fixed per prompt."""
    return CostQualityRouter("random", list(models), metadata={"seed": seed})


@dataclass(frozen=True)
class TrainingParams:
    """Hyperparameters; RouteLLM's MF defaults where they apply."""

    # MF latent dimension (RouteLLM: 128).
    dim: int = 128
    # MF Adam steps over the whole training set, learning rate and weight decay.
    num_epochs: int = 300
    learning_rate: float = 3e-3
    weight_decay: float = 1e-5
    # Classifier inverse regularisation strength (scikit-learn's C).
    inverse_regularization: float = 0.5
    seed: int = 0
    knn: KnnParams = KnnParams()
    mlp: MlpParams = MlpParams()
    domain: DomainParams = DomainParams()


def _symmetric(battles: Battles) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # Each battle in both orientations, so no model gains from being listed first.
    prompt_ids = np.concatenate([battles.prompt_ids, battles.prompt_ids])
    first = np.concatenate([battles.model_a_ids, battles.model_b_ids])
    second = np.concatenate([battles.model_b_ids, battles.model_a_ids])
    outcomes = np.concatenate([battles.outcomes, 1.0 - battles.outcomes]).astype(np.float32)
    return prompt_ids, first, second, outcomes


def _train_mf(battles: Battles, embeddings: np.ndarray, params: TrainingParams) -> tuple[dict[str, np.ndarray], float]:
    import torch

    torch.manual_seed(params.seed)
    num_models, text_dim = len(battles.models), embeddings.shape[1]
    P = torch.nn.Parameter(torch.randn(num_models, params.dim) * 0.1)
    text_proj = torch.nn.Parameter(torch.randn(params.dim, text_dim) / text_dim**0.5)
    head = torch.nn.Parameter(torch.randn(params.dim) / params.dim**0.5)
    optimizer = torch.optim.Adam([P, text_proj, head], lr=params.learning_rate, weight_decay=params.weight_decay)
    prompt_ids, first, second, outcomes = (torch.from_numpy(np.asarray(x)) for x in _symmetric(battles))
    x = torch.from_numpy(embeddings)
    loss = torch.tensor(0.0)
    for _ in range(params.num_epochs):
        optimizer.zero_grad()
        projected = x @ text_proj.T  # [num_prompts, dim]
        model_embeds = torch.nn.functional.normalize(P, dim=1)
        scores = (projected[:, None, :] * model_embeds[None, :, :]) @ head  # [num_prompts, num_models]
        logits = scores[prompt_ids, first] - scores[prompt_ids, second]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, outcomes)
        loss.backward()
        optimizer.step()
    weights = {"P": P.detach().numpy().copy(), "text_proj": text_proj.detach().numpy().copy(),
               "classifier": head.detach().numpy().copy()}
    return weights, float(loss.detach())


def _train_classifier(battles: Battles, embeddings: np.ndarray,
                      params: TrainingParams) -> tuple[dict[str, np.ndarray], float]:
    from sklearn.linear_model import LogisticRegression

    num_models, text_dim = len(battles.models), embeddings.shape[1]
    prompt_ids, first, second, outcomes = _symmetric(battles)
    # Features x (e_a - e_b) and (e_a - e_b): the logit is then score_a - score_b with linear scores.
    sign = np.zeros((len(first), num_models), dtype=np.float32)
    sign[np.arange(len(first)), first] = 1.0
    sign[np.arange(len(first)), second] = -1.0
    x = embeddings[prompt_ids]
    features = np.concatenate([(sign[:, :, None] * x[:, None, :]).reshape(len(first), -1), sign], axis=1)
    # A tie is half a win and half a loss: two rows with weight 1/2 each.
    decisive = outcomes != 0.5
    rows = np.concatenate([np.flatnonzero(decisive), np.flatnonzero(~decisive), np.flatnonzero(~decisive)])
    labels = np.concatenate([outcomes[decisive], np.ones((~decisive).sum()), np.zeros((~decisive).sum())])
    sample_weight = np.concatenate([np.ones(decisive.sum()), np.full(2 * (~decisive).sum(), 0.5)])
    model = LogisticRegression(C=params.inverse_regularization, fit_intercept=False, max_iter=2000)
    model.fit(features[rows], labels.astype(int), sample_weight=sample_weight)
    coef = model.coef_[0]
    weights = {"coef": coef[: num_models * text_dim].reshape(num_models, text_dim).astype(np.float32),
               "bias": coef[num_models * text_dim:].astype(np.float32)}
    probabilities = model.predict_proba(features[rows])[:, 1]
    loss = -np.average(labels * np.log(probabilities + 1e-12) + (1 - labels) * np.log(1 - probabilities + 1e-12),
                       weights=sample_weight)
    return weights, float(loss)


def train_router(kind: RouterKind, data: TrainingData, embedder: Embedder | None,
                 embeddings: np.ndarray | None = None, params: TrainingParams = TrainingParams(),
                 data_info: dict[str, Any] | None = None) -> CostQualityRouter:
    """Trains a router on every row of ``data`` (select the training split first).

    Args:
        embedder: None for ``random`` only, which reads no prompt.
        embeddings: the prompts' embeddings, aligned with ``data.prompts``, when already computed.
        data_info: provenance (path, sha256, split) recorded in the metadata.
    """
    battles = data.to_battles() if isinstance(data, CorrectnessTable) else data
    models = data.strength_order()
    metadata: dict[str, Any] = {"seed": params.seed, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "training": {**(data_info or {}), "num_prompts": len(battles.prompts),
                                             "num_battles": int(len(battles.outcomes)),
                                             "params": asdict(params)}}
    if kind == "random":
        return CostQualityRouter("random", models, None, {}, metadata)
    if embedder is None:
        raise ValueError(f"a {kind} router needs an embedder")
    if embeddings is None:
        embeddings = embedder.embed(battles.prompts, progress=True)
    x, standardise = _standardised(np.asarray(embeddings, dtype=np.float32), embedder)
    if kind == "knn" and standardise:
        raise ValueError(f"knn measures cosine similarity and needs an L2-normalised embedder (minilm or "
                         f"hashing), not {embedder.spec!r}")
    # Reorder the per-model rows so that index i is models[i] (weakest first).
    order = [battles.models.index(name) for name in models]
    loss = None
    if kind == "knn":
        weights = knn_weights(x, battles.points()[:, order])
        metadata["knn"] = asdict(params.knn)
    elif kind == "mlp":
        weights, loss = train_mlp(x, _symmetric(battles), len(battles.models), params.mlp)
        weights["w2"], weights["b2"] = weights["w2"][order], weights["b2"][order]
    elif kind == "mf":
        weights, loss = _train_mf(battles, x, params)
        weights["P"] = weights["P"][order]
    else:
        weights, loss = _train_classifier(battles, x, params)
        weights["coef"], weights["bias"] = weights["coef"][order], weights["bias"][order]
    weights.update(standardise)
    weights["domain_support"], metadata["domain"] = fit_domain(x, params.domain)
    metadata["metrics"] = {"train_loss": loss}
    return CostQualityRouter(kind, models, embedder, weights, metadata)


def _standardised(embeddings: np.ndarray, embedder: Embedder) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    # Hand-written features have their own scales; normalised embeddings are left as they are.
    if getattr(embedder, "normalized", True):
        return embeddings, {}
    mean = embeddings.mean(axis=0)
    std = np.maximum(embeddings.std(axis=0), 1e-6)
    standardised = ((embeddings.astype(np.float64) - mean) / std).astype(np.float32)
    return standardised, {"input_mean": mean.astype(np.float32), "input_std": std.astype(np.float32)}
