"""fleetserve batch against the served app: each answer is the one the same request gets on its own."""

import json
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_a_batch_through_fleetserve_answers_each_request_as_sent_alone(served, tmp_path):
    bodies = {
        "completion": ("/v1/completions", {"model": "tiny", "prompt": "The sea is", "max_tokens": 8,
                                           "temperature": 0}),
        "chat": ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 6, "temperature": 0,
                                          "messages": [{"role": "user", "content": "Name a colour."}]}),
        "routed": ("/v1/completions", {"model": "auto", "prompt": "2 + 2 =", "max_tokens": 4, "temperature": 0}),
        "bad": ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}),
    }
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"
                              for custom_id, (url, body) in bodies.items()))
    output = tmp_path / "results.jsonl"
    done = subprocess.run([sys.executable, "-m", "fleetserve.cli", "batch", str(source), "-o", str(output),
                           "--base-url", served.api_url, "--max-concurrency", "4"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]  # the bad request's 400
    results = {item["custom_id"]: item for item in map(json.loads, output.read_text().splitlines())}
    assert sorted(results) == sorted(bodies)
    bad = results.pop("bad")["response"]
    assert bad["status_code"] == 400 and "max_tokens" in bad["body"]["error"]["message"]
    for custom_id, result in results.items():
        url, body = bodies[custom_id]
        alone = httpx.post(f"{served.base_url}{url}", json=body, timeout=120).json()
        answer = result["response"]
        assert answer["status_code"] == 200 and answer["request_id"]
        assert answer["body"]["choices"] == alone["choices"], custom_id  # greedy: the same tokens
        assert answer["body"]["model"] == alone["model"]
