"""OpenAI's Batch API on the served app, driven by OpenAI's own SDK: each answer is the one the same request gets
on its own."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

BODIES = {
    "tiny": {"model": "tiny", "prompt": "The sea is", "max_tokens": 8, "temperature": 0},
    "smollm2": {"model": "smollm2", "prompt": "Name a colour:", "max_tokens": 6, "temperature": 0},
    "routed": {"model": "auto", "prompt": "2 + 2 =", "max_tokens": 4, "temperature": 0},
    "bad": {"model": "tiny", "prompt": "x", "max_tokens": -1},
}


def test_the_openai_sdk_runs_a_batch_whose_answers_equal_the_requests_sent_alone(served):
    from openai import OpenAI

    client = OpenAI(base_url=served.api_url, api_key="unused", max_retries=0)
    content = "".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})
                      + "\n" for custom_id, body in BODIES.items())
    uploaded = client.files.create(file=("requests.jsonl", content.encode()), purpose="batch")
    assert (uploaded.filename, uploaded.bytes) == ("requests.jsonl", len(content.encode()))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"suite": "served"})
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.id in [listed.id for listed in client.batches.list()]
    answers = {item["custom_id"]: item["response"]
               for item in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    assert sorted(answers) == ["routed", "smollm2", "tiny"]
    for custom_id, answer in answers.items():
        alone = httpx.post(f"{served.api_url}/completions", json=BODIES[custom_id], timeout=120).json()
        assert answer["status_code"] == 200 and answer["request_id"]
        assert answer["body"]["choices"] == alone["choices"], custom_id  # greedy: the same tokens
        assert answer["body"]["model"] == alone["model"]
    [error] = map(json.loads, client.files.content(batch.error_file_id).text.splitlines())
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "max_tokens" in error["response"]["body"]["error"]["message"]
    # A file the SDK would not accept as a batch is refused at upload, naming the line.
    with pytest.raises(Exception, match="line 1: body.stream is true"):
        client.files.create(file=("stream.jsonl", json.dumps({
            "custom_id": "s", "method": "POST", "url": "/v1/completions",
            "body": {**BODIES["tiny"], "stream": True}}).encode()), purpose="batch")
