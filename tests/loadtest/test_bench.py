"""fleetserve bench: its clock, arrival process, goodput arithmetic and failure handling."""

import json
import math
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from fleetserve.loadtest import datasets
from fleetserve.loadtest.arrivals import inter_arrival_times
from fleetserve.loadtest.local_server import free_port
from fleetserve.loadtest.client import RequestRecord
from fleetserve.loadtest.connections import ConnectionPools
from fleetserve.loadtest.metrics import compute_metrics, meets_slos, parse_goodput
from fleetserve.loadtest.runner import BenchConfig, BenchError, request_models, run_benchmark

FIRST_MS, ITL_MS = 200.0, 20.0
SERVER_SCRIPT = Path(__file__).with_name("schedule_server.py")



def start_schedule_server(first_ms: float, itl_ms: float):
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SERVER_SCRIPT), "--port", str(port), "--first-ms", str(first_ms),
                                "--itl-ms", str(itl_ms)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("schedule server did not start")


@pytest.fixture(scope="module")
def schedule_url():
    process, url = start_schedule_server(FIRST_MS, ITL_MS)
    yield url
    process.terminate()
    process.wait(timeout=10)


def specs(num: int, max_tokens: int, prompt: str = "hello world") -> list[datasets.RequestSpec]:
    return [datasets.RequestSpec(prompt, 2, max_tokens) for _ in range(num)]


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_timing_matches_the_known_schedule(schedule_url, api):
    # Poisson arrivals, not a burst: N requests starting at the same instant skew TTFT by ~N ms on
    # both ends (see the client-ceiling benchmark). Warm-ups take the cold path (~30 ms) out of the figures.
    config = BenchConfig(base_url=schedule_url, model="schedule", api=api, request_rate=20.0, seed=5, num_warmups=4)
    result = await run_benchmark(config, specs(16, max_tokens=11))
    metrics = result.metrics
    assert (metrics["completed"], metrics["failed"]) == (16, 0)
    # Tolerance: 15 ms on a 200 ms TTFT and 5 ms on a 20 ms gap (loopback, Python on both ends, 2 cores).
    assert metrics["median_ttft_ms"] == pytest.approx(FIRST_MS, abs=15)
    assert metrics["median_itl_ms"] == pytest.approx(ITL_MS, abs=5)
    assert metrics["median_tpot_ms"] == pytest.approx(ITL_MS, abs=5)
    # E2EL = 200 + 10 gaps x 20 = 400 ms.
    assert metrics["median_e2el_ms"] == pytest.approx(400, abs=25)
    # 16 x 11 tokens over the run, which ends when the last request does (not when the schedule says it should).
    duration = max(record.start + record.e2el for record in result.records)
    assert metrics["output_throughput"] == pytest.approx(16 * 11 / duration)
    assert metrics["total_output_tokens"] == 16 * 11 and metrics["total_input_tokens"] == 16 * 2
    assert all(record.usage_from_server and record.routing == {"x-fleetserve-replica": "sched-0"}
               for record in result.records)


async def test_every_request_leaves_and_none_early(schedule_url):
    config = BenchConfig(base_url=schedule_url, model="schedule", request_rate=20.0, burstiness=1.0, seed=3)
    result = await run_benchmark(config, specs(40, max_tokens=2))
    starts = np.array([record.start for record in result.records])
    expected = np.cumsum(inter_arrival_times(40, 20.0, 1.0, seed=3))
    # How late a request leaves depends on the machine's load; the virtual-clock tests in test_pacing pin the
    # schedule exactly. Here: all 40 leave, each at or after its scheduled time.
    assert len(starts) == 40 and result.metrics["completed"] == 40
    assert np.all(starts >= expected)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_statistics(burstiness):
    gaps = inter_arrival_times(40_000, request_rate=5.0, burstiness=burstiness, seed=1)
    # Mean 1/rate = 0.2 s; gamma's coefficient of variation is 1/sqrt(shape).
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)


def test_infinite_rate_sends_everything_at_once():
    assert inter_arrival_times(5, math.inf).tolist() == [0.0] * 5


def record(ttft: float, e2el: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(ok=ok, ttft=ttft, e2el=e2el, output_tokens=tokens, prompt_tokens=10)


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        record(0.1, 1.0, 10),             # tpot (1.0-0.1)/9 = 100 ms: meets ttft 200 and tpot 100
        record(0.1, 1.9, 10),             # tpot 200 ms: misses tpot
        record(0.3, 0.4, 2),              # ttft 300 ms: misses ttft
        record(0.05, 0.05, 1),            # one token: tpot is not defined, counts as met
        record(0.1, 1.0, 10, ok=False),   # failed requests never count
    ]
    slos = parse_goodput(["ttft:200", "tpot:100"])
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    metrics = compute_metrics(records, duration_s=2.0, percentiles=[50], goodput_slos=slos)
    assert metrics["request_goodput"] == 2 / 2.0  # 2 good requests over 2 s
    assert (metrics["completed"], metrics["failed"]) == (4, 1)
    # TPOT over requests with 2+ tokens: 100, 200 and 100 ms -> mean 133.3.
    assert metrics["mean_tpot_ms"] == pytest.approx(400 / 3)


@pytest.mark.parametrize("bad", [["ttfb:100"], ["ttft:x"], ["ttft:-5"]])
def test_goodput_rejects_bad_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


async def test_failed_requests_are_counted_and_do_not_stop_the_run(schedule_url):
    workload = specs(6, 3) + specs(3, 3, prompt="please FAIL") + specs(2, 3, prompt="BUSY now")
    result = await run_benchmark(BenchConfig(base_url=schedule_url, model="schedule"), workload)
    # 3 failures plus 2 refusals (503 with Retry-After: 2) make 5 failed.
    assert (result.metrics["completed"], result.metrics["failed"]) == (6, 5)
    assert (result.metrics["refused"], result.metrics["refused_with_retry_after"]) == (2, 2)
    assert sorted(record.retry_after for record in result.records if record.refused) == [2.0, 2.0]
    # A refusal's latency is recorded (how fast the front door says no), and stays out of the completed ones'.
    assert all(record.e2el is not None and record.e2el > 0 for record in result.records if not record.ok)
    completed = [record.e2el for record in result.records if record.ok]
    refused = [record.e2el for record in result.records if record.refused]
    assert result.metrics["mean_e2el_ms"] == pytest.approx(sum(completed) / 6 * 1000)
    assert result.metrics["mean_refusal_ms"] == pytest.approx(sum(refused) / 2 * 1000)
    assert result.to_dict(detailed=False)["errors"] == {
        'HTTP 500: {"error":{"message":"asked to fail","type":"internal_error"}}': 3,
        'HTTP 503: {"error":{"message":"at capacity","type":"service_unavailable"}}': 2}


async def test_a_stream_cut_before_done_is_a_failure_not_a_completion(schedule_url):
    result = await run_benchmark(BenchConfig(base_url=schedule_url, model="schedule"),
                                 specs(2, 3) + specs(3, 3, prompt="CUT short"))
    # The 3 cut streams sent all their content, but no [DONE]: partial output, counted as failed.
    assert (result.metrics["completed"], result.metrics["failed"]) == (2, 3)
    assert result.to_dict(detailed=False)["errors"] == {"the stream ended before its end event": 3}


@pytest.mark.parametrize(("count_tokens", "expected"), [
    (lambda text: len(text.split()), 7),   # the tokenizer counts "t0 t1 ... t6": 7 words
    (None, 7),                              # no tokenizer: one token per content chunk, 7 chunks
])
async def test_token_counts_fall_back_when_the_server_sends_no_usage(schedule_url, count_tokens, expected):
    result = await run_benchmark(BenchConfig(base_url=schedule_url, model="schedule"),
                                 specs(2, 7, prompt="NOUSAGE here"), count_tokens=count_tokens)
    assert [(r.usage_from_server, r.output_tokens, r.prompt_tokens) for r in result.records] == [(False, expected, 2)] * 2


async def test_unknown_model_and_unreachable_server_fail_fast(schedule_url):
    with pytest.raises(BenchError, match="model 'nope' is not served .* it serves: schedule"):
        await run_benchmark(BenchConfig(base_url=schedule_url, model="nope"), specs(1, 1))
    started = time.monotonic()
    with pytest.raises(BenchError, match=r"cannot reach http://127.0.0.1:9/v1/models"):
        await run_benchmark(BenchConfig(base_url="http://127.0.0.1:9", model="x"), specs(1, 1))
    assert time.monotonic() - started < 10


def test_datasets_have_the_asked_shapes(tmp_path):
    maker = datasets.PromptMaker(None, random.Random(0))
    rows = datasets.random_dataset(50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=10, maker=maker)
    assert all(60 <= row.prompt_len <= 160 and 10 <= row.max_tokens <= 30 for row in rows)  # 10 + [50, 150]
    prefixed = datasets.shared_prefix_dataset(12, num_groups=3, prefix_len=40, suffix_len=5, output_len=8, maker=maker)
    by_group = {}
    for row in prefixed:
        by_group.setdefault(row.group_id, set()).add(" ".join(row.prompt.split()[:40]))
    assert sorted(by_group) == [0, 1, 2] and all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({next(iter(prefixes)) for prefixes in by_group.values()}) == 3
    lines = tmp_path / "w.jsonl"
    lines.write_text('{"prompt": "a b c", "max_tokens": 7}\n{"prompt": "d"}\n')
    assert [(r.prompt, r.max_tokens) for r in datasets.jsonl_dataset(lines, 3, maker, 5)] == [
        ("a b c", 7), ("d", 5), ("a b c", 7)]
    share = tmp_path / "sg.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi there"},
                                                    {"from": "gpt", "value": "one two three"}]}]))
    assert [(r.prompt, r.prompt_len, r.max_tokens) for r in datasets.sharegpt_dataset(share, 1, maker)] == [
        ("hi there", 2, 3)]
    with pytest.raises(datasets.DatasetError, match="expected a JSON object with a 'prompt'"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text("[1]\n")
        datasets.jsonl_dataset(bad, 1, maker, 5)


def test_tokenizer_gives_exact_prompt_lengths():
    from transformers import AutoTokenizer

    from fleetserve.platform.model_store import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source("tiny-random-llama")))
    maker = datasets.PromptMaker(tokenizer, random.Random(0))
    for length in (1, 17, 100):
        assert len(tokenizer.encode(maker.text(length), add_special_tokens=False)) == length


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetserve.cli", "bench", *args], capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_cli_sweep_saves_plots_and_compares(schedule_url, tmp_path):
    done = run_cli("--base-url", schedule_url, "--model", "schedule", "--num-prompts", "12", "--request-rate", "20,inf",
                   "--random-output-len", "5", "--save-result", str(tmp_path / "sweep.json"), "--save-detailed",
                   "--plot", str(tmp_path / "plots"), "--goodput", "ttft:300")
    assert done.returncode == 0, done.stderr
    assert "Time to First Token" in done.stderr and "Request goodput (req/s)" in done.stderr
    document = json.loads((tmp_path / "sweep.json").read_text())
    assert document["schema_version"] == 1 and [run["config"]["request_rate"] for run in document["runs"]] == [20.0, "inf"]
    assert len(document["runs"][0]["records"]) == 12 and document["runs"][0]["metrics"]["completed"] == 12
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "rate-20-distributions.png", "rate-20-timeline.png", "rate-inf-distributions.png", "rate-inf-timeline.png",
        "sweep.png"]
    compared = subprocess.run([sys.executable, "-m", "fleetserve.cli", "bench", "compare", str(tmp_path / "sweep.json")],
                              capture_output=True, text=True, timeout=60)
    assert compared.returncode == 0 and "sweep@20.0" in compared.stderr and "sweep@inf" in compared.stderr


def test_ctrl_c_prints_and_saves_partial_results(tmp_path):
    process_server, url = start_schedule_server(first_ms=50, itl_ms=50)
    try:
        bench = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "bench", "--base-url", url, "--model",
                                  "schedule", "--num-prompts", "200", "--request-rate", "10", "--random-output-len",
                                  "10", "--save-result", str(tmp_path / "partial.json")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(4)
        bench.send_signal(signal.SIGINT)
        _, stderr = bench.communicate(timeout=60)
    finally:
        process_server.terminate()
    assert bench.returncode == 130
    assert "(interrupted)" in stderr
    run = json.loads((tmp_path / "partial.json").read_text())["runs"][0]
    # About 10 req/s for ~4 s, minus start-up: some, not all, of the 200 were sent and finished.
    assert run["interrupted"] is True and 5 <= run["metrics"]["completed"] < 200


def test_routing_counts_tally_choices_and_leave_out_per_request_numbers():
    from fleetserve.loadtest.client import RequestRecord
    from fleetserve.loadtest.runner import routing_counts

    records = [RequestRecord(routing={"x-fleetserve-replica": replica, "x-fleetserve-win-rate": rate})
               for replica, rate in [("r0", "0.25"), ("r1", "0.5"), ("r0", "0.75")]]
    # r0 answered twice, r1 once; the three win rates are one number per request, not a choice.
    assert routing_counts(records) == {"x-fleetserve-replica": {"r0": 2, "r1": 1}}


async def test_an_api_key_is_sent_as_a_bearer_token_and_never_saved(tmp_path, loopback_server):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from fleetserve.loadtest.report import save_results

    seen: list[str | None] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append(request.headers.get("authorization"))
        return JSONResponse({"error": {"message": "no"}}, status_code=401)

    with loopback_server(app) as server:
        result = await run_benchmark(BenchConfig(base_url=server.url, model="m", api_key="sk-secret-0001"),
                                     specs(2, max_tokens=1))
    assert seen == ["Bearer sk-secret-0001"] * 2
    save_results(tmp_path / "r.json", [result], detailed=True)
    assert "sk-secret" not in (tmp_path / "r.json").read_text()


TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    # 8 requests 0.5 s apart, prompts of 40-110 tokens and outputs of 20-48.
    f"2023-11-16 18:00:{10 + i // 2:02d}.{5 * (i % 2)}000000,{40 + 10 * i},{20 + 4 * i}\n" for i in range(8))


def test_trace_dataset_keeps_recorded_times_and_scaled_lengths(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    maker = datasets.PromptMaker(None, random.Random(0))
    # The window [1, 3) s holds requests 2-5; twice as fast, half the tokens, at most 60 tokens in all.
    window = datasets.trace_dataset(path, maker, start_s=1.0, duration_s=2.0, rate_scale=2.0, length_scale=0.5,
                                    max_len=60)
    assert [spec.send_at_s for spec in window] == [0.0, 0.25, 0.5, 0.75]
    # Request 2: 60 x 0.5 = 30 prompt, 28 x 0.5 = 14 output; request 5: 90 x 0.5 = 45 prompt cut to 60 - 20 = 40.
    assert [(spec.prompt_len, spec.max_tokens) for spec in window] == [(30, 14), (35, 16), (40, 18), (40, 20)]
    assert [len(spec.prompt.split()) for spec in window] == [30, 35, 40, 40]
    with pytest.raises(datasets.DatasetError, match="has no requests in"):
        datasets.trace_dataset(path, maker, start_s=100.0)


async def test_trace_replay_sends_each_request_at_its_recorded_time(schedule_url, tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    specs = datasets.trace_dataset(path, datasets.PromptMaker(None, random.Random(0)), length_scale=0.1)
    result = await run_benchmark(BenchConfig(base_url=schedule_url, model="schedule"), specs)
    assert result.metrics["completed"] == 8
    # Sent at 0, 0.5, ..., 3.5 s, each within 20 ms of its time.
    starts = sorted(record.start for record in result.records)
    assert np.max(np.abs(np.array(starts) - 0.5 * np.arange(8))) < 0.02


def test_cli_trace_refuses_a_request_rate(schedule_url, tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    done = run_cli("--base-url", schedule_url, "--model", "schedule", "--dataset-name", "trace", "--dataset-path",
                   str(path), "--request-rate", "4")
    assert done.returncode == 2 and "a trace brings its own arrival times: drop --request-rate" in done.stderr
    done = run_cli("--base-url", schedule_url, "--model", "schedule", "--dataset-name", "trace", "--dataset-path",
                   str(path), "--trace-length-scale", "0.1", "--num-prompts", "3", "--save-result",
                   str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    # --num-prompts 3 takes the window's first three; the dataset options are recorded with the result.
    assert run["metrics"]["completed"] == 3 and run["config"]["dataset"]["trace_length_scale"] == 0.1
    # The summary names the replay, not the unused request rate's default (inf).
    assert "fleetserve bench: schedule @ trace replay x1" in done.stderr and "@ inf req/s" not in done.stderr


def test_cli_refuses_options_of_another_dataset(schedule_url, tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    done = run_cli("--base-url", schedule_url, "--model", "schedule", "--rate-scale", "2")
    assert done.returncode == 2
    assert "--dataset-name random does not read --rate-scale (for trace): drop it" in " ".join(done.stderr.split())
    done = run_cli("--base-url", schedule_url, "--model", "schedule", "--dataset-name", "trace", "--dataset-path",
                   str(path), "--random-input-len", "5", "--output-len", "3")
    assert done.returncode == 2
    assert ("--dataset-name trace does not read --random-input-len (for random), --output-len (for sharegpt / "
            "jsonl): drop them") in " ".join(done.stderr.split())


def test_several_models_spread_requests_by_zipf_popularity():
    one = BenchConfig(base_url="http://x", model="base")
    assert request_models(one, 3) == ["base"] * 3
    uniform = BenchConfig(base_url="http://x", model="a, b,c", seed=1)
    drawn = request_models(uniform, 3000)
    assert drawn == request_models(uniform, 3000)  # seeded: the same run asks for the same models
    # Uniform over 3: 1000 each expected, sd sqrt(3000 * 1/3 * 2/3) = 25.8; 6 sd = 155.
    assert all(abs(drawn.count(name) - 1000) < 155 for name in "abc")
    skewed = request_models(BenchConfig(base_url="http://x", model="a,b,c", model_zipf=2.0), 3000)
    # Weights 1, 1/4, 1/9: a's share 1 / (1 + 0.25 + 0.111) = 0.735 -> 2204 expected, sd 24.2; 6 sd = 145.
    assert abs(skewed.count("a") - 2204) < 145


def test_requests_take_the_connection_pools_in_turn():
    pools = ConnectionPools(num_pools=3)
    assert [pools.next() for _ in range(7)] == pools.clients * 2 + pools.clients[:1]
    assert pools.first is pools.clients[0]
    with pytest.raises(ValueError, match="num_pools must be at least 1, got 0"):
        ConnectionPools(num_pools=0)


async def test_streams_in_flight_spread_evenly_over_the_connection_pools(schedule_url):
    # 32 streams held open at once, over 16 pools taken in turn: each pool opens exactly 32 / 16 = 2
    # connections, so no pool holds the quadratic share one pool would (connections.py says why).
    payload = {"model": "schedule", "prompt": "hello", "max_tokens": 3, "stream": True}
    async with ConnectionPools(num_pools=16) as pools:
        streams = [pools.next().stream("POST", f"{schedule_url}/v1/completions", json=payload) for _ in range(32)]
        responses = [await stream.__aenter__() for stream in streams]
        held = [len(client._transport._pool.connections) for client in pools.clients]
        for stream in streams:
            await stream.__aexit__(None, None, None)
    assert [response.status_code for response in responses] == [200] * 32
    assert held == [2] * 16


def test_bench_refuses_ignore_eos_where_the_api_has_none(tmp_path):
    refused = subprocess.run([sys.executable, "-m", "fleetserve.cli", "bench", "--base-url", "http://127.0.0.1:9",
                              "--model", "tiny", "--api", "messages", "--ignore-eos"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "the messages API has no ignore_eos" in refused.stderr


@pytest.mark.parametrize(("api", "field"), [("chat", {"user": "group-3"}), ("completions", {"user": "group-3"}),
                                            ("responses", {"user": "group-3"}),
                                            ("messages", {"metadata": {"user_id": "group-3"}})])
def test_a_prefix_group_names_its_session_in_each_apis_end_user_field(api, field):
    from fleetserve.loadtest.client import build_payload

    payload = build_payload(datasets.RequestSpec("p", 1, 4, group_id=3), api, "m", ignore_eos=False)
    assert {key: payload[key] for key in field} == field
    assert ("user" in payload) == (api != "messages")
