"""Fuzzed bodies against a real served engine (the suite's tiny model behind the whole Serve path): no
body gets a 5xx, every refusal is OpenAI error JSON, and the model answers normally afterwards."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

# Small numbers, so bodies reach the engine as real work (max_tokens, n, logprobs) and finish quickly.
JSON = st.recursive(st.none() | st.booleans() | st.integers(-4, 24) | st.floats(-2, 4, allow_nan=False)
                    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = ["messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
          "stream", "n", "logprobs", "top_logprobs", "seed", "stream_options", "user", "echo", "logit_bias",
          "response_format", "tools", "tool_choice", "min_tokens", "presence_penalty"]


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.base_url, timeout=120) as client:
        yield client


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
       prompt=st.sampled_from(["", "hello", "x " * 8]))
def test_random_bodies_reaching_a_real_engine_get_no_5xx(http, path, body, prompt):
    body = {"model": "tiny", **body}
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 16  # the rest of a 1024-token context per request would take minutes in all
    if path == "/v1/chat/completions" and "messages" not in body:
        body["messages"] = [{"role": "user", "content": prompt}]
    if path == "/v1/completions" and "prompt" not in body:
        body["prompt"] = prompt
    response = http.post(path, json=body)
    assert response.status_code < 500, (body, response.text[:300])
    if response.status_code != 200:
        assert set(response.json()["error"]) >= {"message", "type"}, response.text[:300]


def test_the_model_answers_normally_after_the_fuzzing(http):
    reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
