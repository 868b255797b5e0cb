"""fleetserve bench against real servers: fleetserve with the tiny model, and bare vLLM with the same config."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def bench(url: str, out, *extra: str, ignore_eos: bool = True) -> dict:
    done = subprocess.run([sys.executable, "-m", "fleetserve.cli", "bench", "--base-url", url, "--model", "tiny",
                           "--num-prompts", "12", "--request-rate", "inf", "--max-concurrency", "4",
                           "--random-input-len", "32", "--random-output-len", "16",
                           *(["--ignore-eos"] if ignore_eos else []),
                           "--tokenizer", "tiny-random-llama", "--save-result", str(out), "--save-detailed", *extra],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["runs"][0]


def test_bench_against_fleetserve_and_bare_vllm_then_compare(served, bare_vllm, tmp_path):
    ours = bench(served.base_url, tmp_path / "fleetserve.json", "--api", "chat")
    theirs = bench(bare_vllm, tmp_path / "vllm.json", "--api", "chat")
    for run in (ours, theirs):
        # 12 requests x 16 tokens (ignore_eos), counted by the server's usage.
        assert (run["metrics"]["completed"], run["metrics"]["failed"]) == (12, 0)
        assert run["metrics"]["total_output_tokens"] == 12 * 16
        assert all(record["usage_from_server"] for record in run["records"])
    # Only fleetserve says who served each request.
    assert list(ours["routing"]["x-fleetserve-model"]) == ["tiny"]
    assert sum(ours["routing"]["x-fleetserve-replica"].values()) == 12
    assert theirs["routing"] == {}
    compared = subprocess.run([sys.executable, "-m", "fleetserve.cli", "bench", "compare",
                               str(tmp_path / "fleetserve.json"), str(tmp_path / "vllm.json")],
                              capture_output=True, text=True, timeout=60)
    assert compared.returncode == 0
    assert "fleetserve" in compared.stderr and "vllm" in compared.stderr and "ratio" in compared.stderr


def test_bench_loads_anthropic_messages_and_responses_as_their_clients_send_them(served, tmp_path):
    chat = bench(served.base_url, tmp_path / "chat.json", "--api", "chat")
    messages = bench(served.base_url, tmp_path / "messages.json", "--api", "messages", ignore_eos=False)
    responses = bench(served.base_url, tmp_path / "responses.json", "--api", "responses")
    for run in (chat, messages, responses):
        assert (run["metrics"]["completed"], run["metrics"]["failed"]) == (12, 0), run["errors"]
        assert all(record["usage_from_server"] and record["ttft"] is not None for record in run["records"])
    # The same 12 prompts (seed 0), as one user message each: vLLM renders all three the same way.
    assert messages["metrics"]["total_input_tokens"] == responses["metrics"]["total_input_tokens"] == \
        chat["metrics"]["total_input_tokens"]
    # Anthropic's API has no ignore_eos: each answer may stop early, never past the 16-token budget.
    assert all(1 <= record["output_tokens"] <= 16 for record in messages["records"])
    assert responses["metrics"]["total_output_tokens"] == 12 * 16


def _content(url: str, path: str, body: dict) -> str:
    """The generated text of one request: the whole response's, or a stream's deltas joined."""
    import httpx

    if not body.get("stream"):
        choice = httpx.post(f"{url}{path}", json=body, timeout=120).json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    texts = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: "):])["choices"]:
                    texts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(texts)


def test_greedy_content_equals_bare_vllm_serve(served, bare_vllm):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 20,
            "temperature": 0}
    completion = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 20, "temperature": 0}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        for stream in (False, True):
            request = {**body, "stream": stream}
            ours = _content(served.base_url, path, request)
            assert ours and ours == _content(bare_vllm, path, request), (path, stream)
