"""`/v1/embeddings`, `/score` and `/rerank` through fleetserve on an embedding model: vLLM's own endpoints,
checked against the same weights run by transformers."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from cluster_helpers import one_model_app
from factories import model_entry

pytestmark = pytest.mark.slow
TEXTS = ["the cat sat on the mat", "a completely different sentence about ships"]


@pytest.fixture(scope="module")
def embed_app(served):
    # The tiny Llama run as an embedding model: vLLM's pooling runner, last-token pooling, normalised.
    entry = model_entry("embed", extra={"runner": "pooling", "convert": "embed"})
    with one_model_app(served.base_url, "embed", entry, cpu_binding="0") as url:
        yield url


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


def test_embeddings_equal_the_same_weights_run_by_transformers(embed_app):
    response = post(embed_app, "/v1/embeddings", {"model": "embed", "input": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [item["index"] for item in body["data"]] == [0, 1]
    num_tokens = 0
    for text, item in zip(TEXTS, body["data"]):
        token_ids = post(embed_app, "/tokenize", {"model": "embed", "prompt": text}).json()["tokens"]
        num_tokens += len(token_ids)
        vector = np.array(item["embedding"], dtype=np.float32)
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(vector, reference_embedding(token_ids), atol=1e-4)
    assert body["usage"]["prompt_tokens"] == num_tokens


def test_base64_encoding_carries_the_same_floats(embed_app):
    floats = post(embed_app, "/v1/embeddings", {"model": "embed", "input": TEXTS[0]}).json()["data"][0]["embedding"]
    response = post(embed_app, "/v1/embeddings", {"model": "embed", "input": TEXTS[0], "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    decoded = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), dtype=np.float32)
    np.testing.assert_array_equal(decoded, np.array(floats, dtype=np.float32))


def test_an_embeddings_field_vllm_would_ignore_is_refused(embed_app):
    response = post(embed_app, "/v1/embeddings", {"model": "embed", "input": "x", "truncation": "auto"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "truncation" and error["code"] == "unsupported_parameter"


def test_a_generation_endpoint_on_an_embedding_model_is_a_404_naming_it(embed_app):
    response = post(embed_app, "/v1/chat/completions", {"model": "embed",
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    assert "does not serve /v1/chat/completions" in response.json()["error"]["message"]


def embeddings(url: str, texts: list[str]) -> np.ndarray:
    response = post(url, "/v1/embeddings", {"model": "embed", "input": texts})
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float64)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_on_an_embedding_model_is_the_cosine_of_its_embeddings(embed_app, path):
    # vLLM scores pairs on an embedding model as a bi-encoder: cosine(embed(text_1), embed(text_2_i)), and the
    # embeddings are unit vectors, so each score is their dot product.
    query, documents = "the cat", ["the cat sat on the mat", "ships at sea", "a cat"]
    response = post(embed_app, path, {"model": "embed", "text_1": query, "text_2": documents})
    assert response.status_code == 200, response.text
    body = response.json()
    vectors = embeddings(embed_app, [query, *documents])
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([item["score"] for item in body["data"]], vectors[1:] @ vectors[0], atol=1e-5)
    assert body["model"] == "embed"


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_their_score_and_keeps_top_n(embed_app, path):
    query, documents = "the cat", ["ships at sea", "the cat sat on the mat", "a cat", "numbers 1 2 3"]
    response = post(embed_app, path, {"model": "embed", "query": query, "documents": documents, "top_n": 2})
    assert response.status_code == 200, response.text
    vectors = embeddings(embed_app, [query, *documents])
    cosines = vectors[1:] @ vectors[0]
    best_two = list(np.argsort(-cosines)[:2])
    results = response.json()["results"]
    assert [result["index"] for result in results] == best_two
    assert [result["document"]["text"] for result in results] == [documents[index] for index in best_two]
    np.testing.assert_allclose([result["relevance_score"] for result in results], cosines[best_two], atol=1e-5)


def test_a_rerank_field_vllm_would_ignore_is_refused_and_return_documents_true_is_not(embed_app):
    body = {"model": "embed", "query": "q", "documents": ["a", "b"]}
    refused = post(embed_app, "/rerank", {**body, "return_documents": False})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "return_documents"
    # vLLM always returns the documents, which is what `true` asks for.
    assert post(embed_app, "/rerank", {**body, "return_documents": True}).status_code == 200


def test_classify_on_an_embedding_model_is_a_404_naming_the_path(embed_app):
    response = post(embed_app, "/classify", {"model": "embed", "input": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "model `embed` does not serve /classify"
