"""Our mf against RouteLLM's own mf on the same tiny checkpoint (runs only with the routellm extra)."""

from __future__ import annotations

import numpy as np
import pytest
from factories import synthetic_correctness

from fleetserve.router.model.embedders import make_embedder
from fleetserve.router.model.quality_router import train_router
from fleetserve.router.model.routellm_adapter import RouteLLMMFRouter, export_mf, routellm_available

pytestmark = pytest.mark.skipif(not routellm_available(),
                                reason="routellm not installed (pip install 'fleetserve[routellm]')")


def test_our_mf_win_rates_match_routellms_mf_on_the_same_checkpoint(tmp_path):
    data = synthetic_correctness()
    data.models = ["mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"]  # MMLU's pair, in RouteLLM's ids
    embedder = make_embedder("hashing-256")
    ours = train_router("mf", data, embedder)
    checkpoint = export_mf(ours, tmp_path / "routellm-mf")
    theirs = RouteLLMMFRouter(checkpoint, "gpt-4-1106-preview", "mixtral-8x7b-instruct-v0.1", embedder)
    prompts = data.prompts[:12]
    expected = np.array([ours.strong_win_rate(p) for p in prompts])
    got = np.array([theirs.strong_win_rate(p) for p in prompts])
    # RouteLLM computes in float32 torch, we in float64 numpy: equal to float32 precision.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(expected, 4))) > 1  # the rates differ by prompt, so the match means something
