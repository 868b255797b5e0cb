"""`/classify`, `/score` and `/rerank` through fleetserve on a one-label sequence classifier (a cross-encoder):
vLLM's own endpoints, checked against the same weights run by transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from cluster_helpers import one_model_app
from factories import model_entry

pytestmark = pytest.mark.slow
QUERY = "the cat"
DOCUMENTS = ["the cat sat on the mat", "ships at sea", "a cat"]


def build_classifier(out: Path) -> Path:
    """The tiny Llama with a seeded one-label classification head: a cross-encoder's shape."""
    import torch
    from transformers import LlamaForSequenceClassification

    from fleetserve.platform.model_store import tiny_random_llama

    source = tiny_random_llama()
    torch.manual_seed(1)
    model = LlamaForSequenceClassification.from_pretrained(source, num_labels=1, torch_dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for tokenizer_file in source.glob("*token*"):
        shutil.copy(tokenizer_file, out)
    return out


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return build_classifier(tmp_path_factory.mktemp("classifier"))


@pytest.fixture(scope="module")
def classify_app(served, classifier):
    entry = model_entry("judge", source=str(classifier), extra={"runner": "pooling"})
    with one_model_app(served.base_url, "classify-app", entry, cpu_binding="1") as url:
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def reference_probability(classifier: Path, *texts: str) -> float:
    """sigmoid of the head's logit at the last token, as transformers runs the checkpoint; two texts are a
    pair, tokenized as the tokenizer joins pairs."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(classifier)
    model = LlamaForSequenceClassification.from_pretrained(classifier, torch_dtype=torch.float32)
    token_ids = tokenizer(*texts, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        return torch.sigmoid(model(input_ids=token_ids).logits[0, 0]).item()


def test_classify_equals_the_same_weights_run_by_transformers(classify_app, classifier):
    response = post(classify_app, "/classify", {"model": "judge", "input": DOCUMENTS[:2]})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [(item["index"], item["num_classes"]) for item in data] == [(0, 1), (1, 1)]
    for text, item in zip(DOCUMENTS, data):
        assert item["probs"][0] == pytest.approx(reference_probability(classifier, text), abs=1e-5)


def test_score_on_a_cross_encoder_reads_each_pair_together(classify_app, classifier):
    response = post(classify_app, "/score", {"model": "judge", "queries": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    scores = [item["score"] for item in response.json()["data"]]
    expected = [reference_probability(classifier, QUERY, document) for document in DOCUMENTS]
    np.testing.assert_allclose(scores, expected, atol=1e-5)


def test_rerank_on_a_cross_encoder_returns_every_document_best_first(classify_app, classifier):
    response = post(classify_app, "/v2/rerank", {"model": "judge", "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    expected = [reference_probability(classifier, QUERY, document) for document in DOCUMENTS]
    results = response.json()["results"]
    assert [result["index"] for result in results] == list(np.argsort(expected)[::-1])
    np.testing.assert_allclose([result["relevance_score"] for result in results], sorted(expected, reverse=True),
                               atol=1e-5)
