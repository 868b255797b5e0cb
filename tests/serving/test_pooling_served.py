"""vLLM's pooling endpoints through fleetserve, on one app of two pooling models: `/v1/embeddings`, `/score` and
`/rerank` on an embedding model, and `/classify`, `/score` and `/rerank` on a one-label sequence classifier (a
cross-encoder), each checked against the same weights run by transformers."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from factories import model_entry

from fleetserve.platform.config import parse_config

pytestmark = pytest.mark.slow
TEXTS = ["the cat sat on the mat", "a completely different sentence about ships"]
QUERY = "the cat"
DOCUMENTS = ["the cat sat on the mat", "ships at sea", "a cat"]
APP = "pooling"


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
def pooling_app(served, classifier):
    from ray import serve

    from fleetserve.deployments.builders import build_app

    # The tiny Llama run as an embedding model (vLLM's pooling runner, last-token pooling, normalised), and
    # with a seeded one-label head as a cross-encoder; one app, an engine on each core, started together.
    entries = [model_entry("embed", extra={"runner": "pooling", "convert": "embed"}),
               model_entry("judge", source=str(classifier), extra={"runner": "pooling"})]
    config = parse_config({"models": [{**entry, "resources": {"num_cpus": 0.1, "cpu_binding": [core]}}
                                      for entry, core in zip(entries, ("0", "1"))]})
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield f"{served.base_url}/{APP}"
    serve.delete(APP)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def reference_embedding(token_ids: list[int]) -> np.ndarray:
    """The last token's final hidden state, L2-normalised, from transformers on the same weights."""
    import torch
    from transformers import AutoModel

    from fleetserve.platform.model_store import tiny_random_llama

    model = AutoModel.from_pretrained(tiny_random_llama(), torch_dtype=torch.float32)
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0).numpy()


def test_embeddings_equal_the_same_weights_run_by_transformers(pooling_app):
    response = post(pooling_app, "/v1/embeddings", {"model": "embed", "input": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [item["index"] for item in body["data"]] == [0, 1]
    num_tokens = 0
    for text, item in zip(TEXTS, body["data"]):
        token_ids = post(pooling_app, "/tokenize", {"model": "embed", "prompt": text}).json()["tokens"]
        num_tokens += len(token_ids)
        vector = np.array(item["embedding"], dtype=np.float32)
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(vector, reference_embedding(token_ids), atol=1e-4)
    assert body["usage"]["prompt_tokens"] == num_tokens


def test_base64_encoding_carries_the_same_floats(pooling_app):
    floats = post(pooling_app, "/v1/embeddings", {"model": "embed", "input": TEXTS[0]}).json()["data"][0]["embedding"]
    response = post(pooling_app, "/v1/embeddings", {"model": "embed", "input": TEXTS[0], "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    decoded = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), dtype=np.float32)
    np.testing.assert_array_equal(decoded, np.array(floats, dtype=np.float32))


def test_an_embeddings_field_vllm_would_ignore_is_refused(pooling_app):
    response = post(pooling_app, "/v1/embeddings", {"model": "embed", "input": "x", "truncation": "auto"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "truncation" and error["code"] == "unsupported_parameter"


def test_a_generation_endpoint_on_an_embedding_model_is_a_404_naming_it(pooling_app):
    response = post(pooling_app, "/v1/chat/completions", {"model": "embed",
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    assert "does not serve /v1/chat/completions" in response.json()["error"]["message"]


def embeddings(url: str, texts: list[str]) -> np.ndarray:
    response = post(url, "/v1/embeddings", {"model": "embed", "input": texts})
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float64)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_on_an_embedding_model_is_the_cosine_of_its_embeddings(pooling_app, path):
    # vLLM scores pairs on an embedding model as a bi-encoder: cosine(embed(text_1), embed(text_2_i)), and the
    # embeddings are unit vectors, so each score is their dot product.
    query, documents = "the cat", ["the cat sat on the mat", "ships at sea", "a cat"]
    response = post(pooling_app, path, {"model": "embed", "text_1": query, "text_2": documents})
    assert response.status_code == 200, response.text
    body = response.json()
    vectors = embeddings(pooling_app, [query, *documents])
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([item["score"] for item in body["data"]], vectors[1:] @ vectors[0], atol=1e-5)
    assert body["model"] == "embed"


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_their_score_and_keeps_top_n(pooling_app, path):
    query, documents = "the cat", ["ships at sea", "the cat sat on the mat", "a cat", "numbers 1 2 3"]
    response = post(pooling_app, path, {"model": "embed", "query": query, "documents": documents, "top_n": 2})
    assert response.status_code == 200, response.text
    vectors = embeddings(pooling_app, [query, *documents])
    cosines = vectors[1:] @ vectors[0]
    best_two = list(np.argsort(-cosines)[:2])
    results = response.json()["results"]
    assert [result["index"] for result in results] == best_two
    assert [result["document"]["text"] for result in results] == [documents[index] for index in best_two]
    np.testing.assert_allclose([result["relevance_score"] for result in results], cosines[best_two], atol=1e-5)


def test_a_rerank_field_vllm_would_ignore_is_refused_and_return_documents_true_is_not(pooling_app):
    body = {"model": "embed", "query": "q", "documents": ["a", "b"]}
    refused = post(pooling_app, "/rerank", {**body, "return_documents": False})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "return_documents"
    # vLLM always returns the documents, which is what `true` asks for.
    assert post(pooling_app, "/rerank", {**body, "return_documents": True}).status_code == 200


def test_classify_on_an_embedding_model_is_a_404_naming_the_path(pooling_app):
    response = post(pooling_app, "/classify", {"model": "embed", "input": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "model `embed` does not serve /classify"


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


def test_classify_equals_the_same_weights_run_by_transformers(pooling_app, classifier):
    response = post(pooling_app, "/classify", {"model": "judge", "input": DOCUMENTS[:2]})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [(item["index"], item["num_classes"]) for item in data] == [(0, 1), (1, 1)]
    for text, item in zip(DOCUMENTS, data):
        assert item["probs"][0] == pytest.approx(reference_probability(classifier, text), abs=1e-5)


def test_score_on_a_cross_encoder_reads_each_pair_together(pooling_app, classifier):
    response = post(pooling_app, "/score", {"model": "judge", "queries": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    scores = [item["score"] for item in response.json()["data"]]
    expected = [reference_probability(classifier, QUERY, document) for document in DOCUMENTS]
    np.testing.assert_allclose(scores, expected, atol=1e-5)


def test_rerank_on_a_cross_encoder_returns_every_document_best_first(pooling_app, classifier):
    response = post(pooling_app, "/v2/rerank", {"model": "judge", "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    expected = [reference_probability(classifier, QUERY, document) for document in DOCUMENTS]
    results = response.json()["results"]
    assert [result["index"] for result in results] == list(np.argsort(expected)[::-1])
    np.testing.assert_allclose([result["relevance_score"] for result in results], sorted(expected, reverse=True),
                               atol=1e-5)
