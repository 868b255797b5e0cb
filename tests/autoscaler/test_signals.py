"""What an engine replica reports to the autoscaler about its prefill backlog (fake engine, no Ray)."""

from __future__ import annotations

import asyncio

from fleetserve.deployments.engine_server import EngineRequest, EngineServer
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import SamplingOptions


def slow_server(fake_engine_cls) -> EngineServer:
    class SlowFirstToken(fake_engine_cls):
        first_token_s = 0.3

    return EngineServer(ModelConfig(name="fake", source="unused"), engine_cls=SlowFirstToken, model_path="/unused")


def request(request_id: str, prompt: str) -> EngineRequest:
    return EngineRequest(request_id, SamplingOptions(max_tokens=2), prompt=prompt)


async def test_prompts_count_as_backlog_until_their_first_output(fake_engine_cls):
    server = slow_server(fake_engine_cls)
    streams = [server.generate(request("a", "w1 w2 w3 w4")), server.generate(request("b", "w1 w2"))]
    firsts = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
    await asyncio.sleep(0.1)
    # 4 + 2 prompt tokens wait for their first token.
    assert server.autoscaling_signals()["num_pending_prompt_tokens"] == 6
    await asyncio.gather(*firsts)
    assert server.num_pending_prompt_tokens == 0
    for stream in streams:
        async for _ in stream:
            pass
    assert server.autoscaling_signals()["num_pending_prompt_tokens"] == 0


async def test_a_stream_closed_before_its_first_output_gives_its_backlog_back(fake_engine_cls):
    server = slow_server(fake_engine_cls)
    stream = server.generate(request("gone", "w1 w2 w3"))
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.1)
    assert server.num_pending_prompt_tokens == 3
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await stream.aclose()
    assert server.num_pending_prompt_tokens == 0


def test_serve_adapter_reads_every_signal_a_replica_reports():
    from fleetserve.autoscaler.serve_adapter import _signals

    # Serve's aggregated_metrics: metric name -> replica id -> value; replica "b" has not reported yet.
    reported = {"kv_cache_usage": 0.5, "num_waiting": 2.0, "num_running": 3.0, "tokens_per_s": 900.0,
                "prompt_tokens_per_s": 700.0, "num_pending_prompt_tokens": 1200.0, "ttft_s": float("nan")}
    metrics = {name: {"a": value} for name, value in reported.items()}
    (signals,) = _signals(metrics, ["a", "b"])
    assert (signals.kv_cache_usage, signals.num_waiting, signals.num_running, signals.tokens_per_s,
            signals.prompt_tokens_per_s, signals.num_pending_prompt_tokens, signals.ttft_s) == (
        0.5, 2, 3, 900.0, 700.0, 1200, None)
