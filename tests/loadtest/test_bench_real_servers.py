"""fleetserve bench against real servers: fleetserve with the tiny model, and bare vLLM with the same config."""

import json
import subprocess
import sys


def bench(url: str, out, *extra: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "fleetserve.cli", "bench", "--base-url", url, "--model", "tiny",
                           "--num-prompts", "12", "--request-rate", "inf", "--max-concurrency", "4",
                           "--random-input-len", "32", "--random-output-len", "16", "--ignore-eos",
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
