"""What an engine replica reports to the autoscaler about its prefill backlog (fake engine, no Ray)."""

from __future__ import annotations

import asyncio

from types import SimpleNamespace

from fleetserve.platform.engine import _ObservedClient


class StubLLM:
    """Yields two outputs per request, the first after ``first_output_s``."""

    first_output_s = 0.3

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        await asyncio.sleep(self.first_output_s)
        yield "out-1"
        yield "out-2"


def observed() -> tuple[_ObservedClient, SimpleNamespace]:
    engine = SimpleNamespace(num_pending_prompt_tokens=0)
    return _ObservedClient(StubLLM(), engine), engine


async def drain(stream) -> list:
    return [item async for item in stream]


async def test_prompts_count_as_backlog_until_their_first_output():
    client, engine = observed()
    params = SimpleNamespace(extra_args=None)
    tasks = [asyncio.ensure_future(drain(client.generate({"prompt_token_ids": ids}, params, name)))
             for name, ids in (("a", [1, 2, 3, 4]), ("b", [5, 6]))]
    await asyncio.sleep(0.1)
    # 4 + 2 prompt tokens wait for their first output.
    assert engine.num_pending_prompt_tokens == 6
    assert await asyncio.gather(*tasks) == [["out-1", "out-2"]] * 2
    assert engine.num_pending_prompt_tokens == 0


async def test_a_stream_closed_before_its_first_output_gives_its_backlog_back():
    client, engine = observed()
    task = asyncio.ensure_future(drain(client.generate({"prompt_token_ids": [1, 2, 3]},
                                                       SimpleNamespace(extra_args=None), "gone")))
    await asyncio.sleep(0.1)
    assert engine.num_pending_prompt_tokens == 3
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert engine.num_pending_prompt_tokens == 0


async def test_a_prompt_whose_kv_comes_from_a_prefill_replica_is_no_backlog():
    client, engine = observed()
    params = SimpleNamespace(extra_args={"kv_transfer_params": {"do_remote_prefill": True}})
    task = asyncio.ensure_future(drain(client.generate({"prompt_token_ids": [1, 2, 3]}, params, "pd")))
    await asyncio.sleep(0.1)
    assert engine.num_pending_prompt_tokens == 0
    await task


def test_serve_adapter_reads_every_signal_a_replica_reports():
    from fleetserve.autoscaler.serve_adapter import _reports

    # Serve's aggregated_metrics: metric name -> replica id -> value; replica "b" has not reported yet.
    reported = {"kv_cache_usage": 0.5, "num_waiting": 2.0, "num_running": 3.0, "tokens_per_s": 900.0,
                "prompt_tokens_per_s": 700.0, "num_pending_prompt_tokens": 1200.0, "ttft_s": float("nan")}
    metrics = {name: {"a": value} for name, value in reported.items()}
    (signals,) = _reports(metrics, ["a", "b"], "colocated")
    assert (signals.kv_cache_usage, signals.num_waiting, signals.num_running, signals.tokens_per_s,
            signals.prompt_tokens_per_s, signals.num_pending_prompt_tokens, signals.ttft_s) == (
        0.5, 2, 3, 900.0, 700.0, 1200, None)
    assert (signals.replica_id, signals.pool) == ("a", "colocated")
