"""Optional: RouteLLM's own mf router behind fleetserve's interface (``pip install 'fleetserve[routellm]'``).

RouteLLM embeds prompts with OpenAI's embeddings API, which an offline cluster cannot reach; the
adapter hands RouteLLM's ``MFModel`` embeddings from a fleetserve embedder instead, so a RouteLLM
checkpoint trained on those embeddings routes here unchanged. ``export_mf`` writes a fleetserve mf
router as a RouteLLM checkpoint, which is how the two implementations are compared.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fleetserve.router.model.embedders import Embedder
from fleetserve.router.model.quality_router import CostQualityRouter


def routellm_available() -> bool:
    """Whether the ``routellm`` package (and what its mf router imports) is installed."""
    try:
        _import_routellm()
    except ImportError:
        return False
    return True


def _import_routellm() -> Any:
    # routellm builds an OpenAI client at import time, which needs a key even when never used.
    os.environ.setdefault("OPENAI_API_KEY", "unused-offline")
    from routellm.routers import routers
    from routellm.routers.matrix_factorization import model

    return SimpleNamespace(routers=routers, model=model)


class _OfflineEmbeddings:
    """Stands in for ``OpenAI().embeddings``: answers ``create(input=[text], model=...)`` from an embedder."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self.embeddings = self

    def create(self, input: list[str], model: str) -> Any:  # noqa: A002 - OpenAI's parameter name
        vectors = self.embedder.embed(list(input))
        return SimpleNamespace(data=[SimpleNamespace(embedding=vector.tolist()) for vector in vectors])


class RouteLLMMFRouter:
    """RouteLLM's ``MatrixFactorizationRouter`` with ``strong_win_rate(prompt)``, embeddings from ``embedder``.

    Args:
        checkpoint: a local RouteLLM MFModel folder (``config.json`` + ``model.safetensors``).
        strong_model, weak_model: names in RouteLLM's ``MODEL_IDS``.
        embedder: must be the embedding space the checkpoint was trained in.
    """

    def __init__(self, checkpoint: str | Path, strong_model: str, weak_model: str, embedder: Embedder,
                 hidden_size: int = 128, num_models: int = 64) -> None:
        routellm = _import_routellm()
        # MFModel.forward reads this module global for every prompt.
        routellm.model.OPENAI_CLIENT = _OfflineEmbeddings(embedder)
        self.router = routellm.routers.MatrixFactorizationRouter(
            str(checkpoint), strong_model=strong_model, weak_model=weak_model, hidden_size=hidden_size,
            num_models=num_models, text_dim=embedder.dim)

    def strong_win_rate(self, prompt: str) -> float:
        return float(self.router.calculate_strong_win_rate(prompt))


def export_mf(router: CostQualityRouter, directory: str | Path, model_ids: dict[str, str] | None = None) -> Path:
    """Writes a fleetserve mf router as a RouteLLM MFModel checkpoint (64 model slots, RouteLLM's ids).

    Args:
        model_ids: fleetserve model name -> RouteLLM model name; names already in RouteLLM's
            ``MODEL_IDS`` (case-insensitively, without an org prefix) map themselves.
    """
    import torch

    routellm = _import_routellm()
    if router.kind != "mf":
        raise ValueError(f"only mf routers have a RouteLLM equivalent, not {router.kind!r}")
    ids = routellm.model.MODEL_IDS
    dim, text_dim = router.weights["text_proj"].shape
    mf = routellm.model.MFModel(dim=dim, num_models=len(ids), text_dim=text_dim, num_classes=1, use_proj=True)
    with torch.no_grad():
        for index, name in enumerate(router.models):
            routellm_name = (model_ids or {}).get(name) or name.split("/")[-1].lower()
            if routellm_name not in ids:
                raise ValueError(f"{name!r} is not a RouteLLM model; map it with model_ids")
            mf.P.weight[ids[routellm_name]] = torch.from_numpy(router.weights["P"][index])
        mf.text_proj[0].weight.copy_(torch.from_numpy(router.weights["text_proj"]))
        mf.classifier[0].weight.copy_(torch.from_numpy(router.weights["classifier"][None, :]))
    directory = Path(directory)
    mf.save_pretrained(directory)
    return directory
