"""vLLM-named engine metrics, exposition merging and the status view's arithmetic, without a server."""

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, PrefixCacheStats, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from fleetserve.deployments.ingress.metrics import IngressMetrics
from fleetserve.platform.metrics import EngineMetrics, StartupPhase, merge_expositions
from fleetserve.ops.status import parse_metrics, status_table

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "fleetserve" / "dashboards" / "fleetserve.json"


def samples(text: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def step(num_running=2, num_waiting=1, kv=0.25, queries=10, hits=4, prompt=10, generated=3, ttfts=(0.2,),
         itls=(0.01, 0.02), finished=1) -> tuple[SchedulerStats, IterationStats]:
    scheduler = SchedulerStats(num_running_reqs=num_running, num_waiting_reqs=num_waiting, kv_cache_usage=kv,
                               prefix_cache_stats=PrefixCacheStats(requests=1, queries=queries, hits=hits))
    iteration = IterationStats()
    iteration.prompt_token_stats.total, iteration.num_generation_tokens = prompt, generated
    iteration.time_to_first_tokens_iter, iteration.inter_token_latencies_iter = list(ttfts), list(itls)
    iteration.finished_requests = [FinishedRequestStats(finish_reason="length", e2e_latency=1.5)] * finished
    return scheduler, iteration


def test_engine_metrics_use_vllm_names_labels_and_accumulate():
    metrics = EngineMetrics("m", "r0", "decode")
    metrics.record(*step())
    metrics.record(*step(num_running=0, num_waiting=0, kv=0.0, finished=0, ttfts=()))
    got = samples(metrics.exposition())
    labels = (("model_name", "m"), ("pool", "decode"), ("replica", "r0"))
    # Gauges hold the last step; counters add both steps: 10 + 10 prompt tokens, 3 + 3 generated, 4 + 4 hits.
    assert got[("vllm:num_requests_running", labels)] == 0 and got[("vllm:kv_cache_usage_perc", labels)] == 0
    assert got[("vllm:prompt_tokens_total", labels)] == 20 and got[("vllm:generation_tokens_total", labels)] == 6
    assert got[("vllm:prefix_cache_hits_total", labels)] == 8 and got[("vllm:prefix_cache_queries_total", labels)] == 20
    assert got[("vllm:request_success_total", (("finished_reason", "length"), *labels))] == 1
    assert got[("vllm:time_to_first_token_seconds_count", labels)] == 1
    assert got[("vllm:inter_token_latency_seconds_count", labels)] == 4   # 2 gaps per step
    assert got[("vllm:e2e_request_latency_seconds_sum", labels)] == 1.5


def test_lora_info_names_the_current_adapters_only():
    metrics = EngineMetrics("m", "r0", max_loras=2)
    first, _ = step()
    first.running_lora_adapters, first.waiting_lora_adapters = {"a": 1, "b": 2}, {"c": 1}
    metrics.record(first, None)
    second, _ = step()
    second.running_lora_adapters, second.waiting_lora_adapters = {"c": 1}, {}
    metrics.record(second, None)
    info = [(dict(s.labels), s.value) for family in text_string_to_metric_families(metrics.exposition().decode())
            for s in family.samples if s.name == "vllm:lora_requests_info"]
    # One series, the second step's, valued at its time (vLLM's semantics: a timestamp gauge).
    assert [(labels["running_lora_adapters"], labels["waiting_lora_adapters"], labels["max_lora"])
            for labels, _ in info] == [("c", "", "2")]
    assert info[0][1] > 1.7e9
    assert b"vllm:lora_requests_info" not in EngineMetrics("m", "r0").exposition()  # no LoRA, no series


def spec_step(drafts: list[tuple[int, int]], num_spec_tokens: int = 3) -> SchedulerStats:
    """A step whose drafts each proposed and had accepted the (draft tokens, accepted tokens) given."""
    scheduler, _ = step()
    scheduler.spec_decoding_stats = SpecDecodingStats.new(num_spec_tokens)
    for num_draft_tokens, num_accepted_tokens in drafts:
        scheduler.spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted_tokens)
    return scheduler


@pytest.mark.parametrize("declared", [3, None])
def test_speculative_decoding_counts_drafts_under_vllms_names(declared):
    metrics = EngineMetrics("m", "r0", num_speculative_tokens=declared)
    metrics.record(spec_step([(3, 3), (3, 1)]), None)
    metrics.record(spec_step([(3, 0)]), None)
    got = {(name, dict(labels).get("position")): value
           for (name, labels), value in samples(metrics.exposition()).items() if name.startswith("vllm:spec_decode")}
    # 3 drafts of 3 tokens; accepted 3 + 1 + 0; position 0 accepted by the first two drafts, 1 and 2 by the first.
    assert got == {("vllm:spec_decode_num_drafts_total", None): 3, ("vllm:spec_decode_num_draft_tokens_total", None): 9,
                   ("vllm:spec_decode_num_accepted_tokens_total", None): 4,
                   ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0"): 2,
                   ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1"): 1,
                   ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "2"): 1}


def test_the_dashboards_speculative_decoding_series_are_the_engines():
    names = {name for name in dashboard_metric_names() if name.startswith("vllm:spec_decode")}
    assert names == {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"}
    assert names <= {name for name, _ in samples(EngineMetrics("m", "r0", num_speculative_tokens=2).exposition())}


def test_speculative_decoding_series_start_at_zero_when_declared_and_are_absent_without_it():
    assert b"vllm:spec_decode_num_drafts_total{" in EngineMetrics("m", "r0", num_speculative_tokens=2).exposition()
    plain = EngineMetrics("m", "r0")
    plain.record(*step())
    assert b"spec_decode" not in plain.exposition()


def test_merged_exposition_keeps_every_replica_and_parses():
    replicas = [EngineMetrics("m", f"r{i}") for i in range(2)]
    for replica in replicas:
        replica.record(*step())
    merged = merge_expositions([IngressMetrics().exposition()] + [r.exposition() for r in replicas])
    text = merged.decode()
    assert text.count("# TYPE vllm:prompt_tokens_total counter") == 1
    got = samples(merged)
    assert sum(v for (name, _), v in got.items() if name == "vllm:request_success_total") == 2


def test_status_table_rates_between_two_scrapes():
    metrics = EngineMetrics("m", "r0")
    metrics.set_node("0123456789abcdef", "10.0.0.7")
    metrics.record(*step(generated=10))
    before = parse_metrics(metrics.exposition().decode(), taken_at=100.0)
    metrics.record(*step(generated=30, kv=0.5))
    after = parse_metrics(metrics.exposition().decode(), taken_at=102.0)
    table = status_table(before, after, "http://x")
    row = [column._cells[0] for column in table.columns]
    # The node's first 8 hex digits; 30 tokens in 2 s = 15.0 tok/s; prompt 10 in 2 s = 5.0; hits 8 of 20 = 40%.
    assert row == ["m", "colocated", "r0", "01234567", "50.0%", "2", "1", "15.0", "5.0", "40%", "-", "2"]


def test_status_shows_the_share_of_draft_tokens_accepted():
    metrics = EngineMetrics("m", "r0", num_speculative_tokens=3)
    metrics.record(spec_step([(3, 3), (3, 1)]), None)
    scrape = parse_metrics(metrics.exposition().decode(), taken_at=1.0)
    # 4 of 6 draft tokens accepted.
    assert [column._cells[0] for column in status_table(scrape, scrape, "x").columns][10] == "67%"


def test_status_table_without_node_info_shows_a_dash():
    metrics = EngineMetrics("m", "r0")
    scrape = parse_metrics(metrics.exposition().decode(), taken_at=1.0)
    assert [column._cells[0] for column in status_table(scrape, scrape, "x").columns][3] == "-"


def test_status_names_models_at_zero_and_their_held_requests():
    ingress = IngressMetrics()
    for model, count in (("busy", 1), ("idle", 0), ("waking", 0)):
        ingress.replicas.labels(model, "colocated").set(count)
    ingress.held.labels("waking").set(2)
    busy = EngineMetrics("busy", "r0")
    scrape = parse_metrics(merge_expositions([ingress.exposition(), busy.exposition()]).decode(), taken_at=1.0)
    assert status_table(scrape, scrape, "x").caption == "busy: 1 replica  idle: at zero  waking: at zero, 2 held"


def test_status_once_into_a_pipe_prints_whole_cells(monkeypatch):
    from typer.testing import CliRunner

    from fleetserve.cli.main import app

    metrics = EngineMetrics("llama-3-8b-instruct-support-bot", "r0", pool="decode")
    metrics.set_node("0123456789abcdef", "10.0.0.7")
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr("fleetserve.ops.status.fetch", lambda url, client, now: parse_metrics(
        metrics.exposition().decode(), taken_at=now))
    result = CliRunner().invoke(app, ["status", "--once", "--interval", "0"])
    assert result.exit_code == 0, result.output
    # Before, rich cut every cell to fit 80 columns ("lla…", "dec…", "pro…") where a script reads them.
    row = next(line for line in result.stdout.splitlines() if "r0" in line)
    assert [cell.strip() for cell in row.split("│")[1:5]] == ["llama-3-8b-instruct-support-bot", "decode", "r0",
                                                             "01234567"]
    assert "prompt tok/s" in result.stdout


def test_node_info_names_the_replica_and_its_node():
    metrics = EngineMetrics("m", "r0", pool="decode")
    metrics.set_node("ab" * 28, "10.0.0.7")
    assert samples(metrics.exposition())[("fleetserve_replica_node_info", (
        ("model_name", "m"), ("node_id", "ab" * 28), ("node_ip", "10.0.0.7"), ("pool", "decode"),
        ("replica", "r0")))] == 1.0


def test_startup_phases_are_timed_and_a_phase_that_raises_is_not_recorded():
    ticks = iter([10.0, 12.5, 20.0, 61.0, 70.0])
    metrics = EngineMetrics("m", "r0", clock=lambda: next(ticks))
    metrics.set_start_time(1_800_000_000.0)
    with metrics.startup_phase(StartupPhase.MODEL_FILES):  # 10.0 -> 12.5
        pass
    with metrics.startup_phase(StartupPhase.ENGINE):  # 20.0 -> 61.0
        pass
    with pytest.raises(RuntimeError), metrics.startup_phase(StartupPhase.APP):  # began at 70.0, never ended
        raise RuntimeError("vLLM's app failed")
    got = samples(metrics.exposition())
    phases = {dict(labels)["phase"]: value for (name, labels), value in got.items()
              if name == "fleetserve_replica_startup_seconds"}
    assert phases == {"model_files": 2.5, "engine": 41.0}
    assert got[("fleetserve_replica_start_time_seconds",
                (("model_name", "m"), ("pool", "colocated"), ("replica", "r0")))] == 1_800_000_000.0


def dashboard_metric_names() -> set[str]:
    exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]
    return {name for expr in exprs for name in re.findall(r"\b(vllm:[a-z0-9_]+|fleetserve_[a-z0-9_]+)", expr)}


def test_dashboard_covers_the_asked_panels():
    names = dashboard_metric_names()
    for needed in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:generation_tokens_total",
                   "fleetserve_requests_total", "fleetserve_routing_decisions_total",
                   "fleetserve_estimated_cost_dollars_total"):
        assert needed in names


async def test_metrics_answer_without_the_engines_when_the_hub_hangs(monkeypatch):
    import asyncio

    import httpx

    from fleetserve.deployments.ingress import server as ingress_server

    monkeypatch.setattr(ingress_server, "METRICS_SOURCE_TIMEOUT_S", 0.2)
    hub_calls = []

    async def hub() -> tuple[list[bytes], dict]:
        hub_calls.append(1)
        if len(hub_calls) == 1:
            await asyncio.sleep(3600)  # the hung hub: Serve replaces it in about a minute
        exposition = b'vllm:num_requests_running{model_name="m",replica="r0",pool="colocated"} 2.0\n'
        return [exposition], {("m", "colocated"): 1}

    app = ingress_server.OpenAIIngress({}, metrics_source=hub)
    transport = httpx.ASGITransport(app=app.build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
        hung = await client.get("/metrics")
        answered = await client.get("/metrics")
    # The first scrape got the ingress's own metrics, counted as incomplete, instead of hanging for the hub.
    assert hung.status_code == 200 and "vllm:" not in hung.text
    assert samples(hung.content)[("fleetserve_scrapes_without_engines_total", ())] == 1.0
    assert samples(answered.content)[("vllm:num_requests_running",
                                      (("model_name", "m"), ("pool", "colocated"), ("replica", "r0")))] == 2.0


async def test_every_served_pool_has_a_replica_count_zero_included():
    import httpx

    from fleetserve.deployments.ingress import server as ingress_server
    from fleetserve.platform.config import parse_config

    config = parse_config({"models": [
        {"name": "up", "source": "x"},
        {"name": "idle", "source": "x", "replicas": 0, "autoscaling": {"policy": "kv_cache", "min_replicas": 0,
                                                                       "max_replicas": 1}},
        {"name": "pd", "source": "x", "disaggregation": {"prefill": {}, "decode": {}}}]})

    async def hub() -> tuple[list[bytes], dict]:
        return [], {("up", "colocated"): 2, ("pd", "decode"): 1}

    app = ingress_server.OpenAIIngress({}, metrics_source=hub, models={m.name: m for m in config.models})
    transport = httpx.ASGITransport(app=app.build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
        got = samples((await client.get("/metrics")).content)
    counts = {labels: value for (name, labels), value in got.items() if name == "fleetserve_replicas"}
    assert counts == {(("model", "up"), ("pool", "colocated")): 2.0, (("model", "idle"), ("pool", "colocated")): 0.0,
                      (("model", "pd"), ("pool", "prefill")): 0.0, (("model", "pd"), ("pool", "decode")): 1.0}
