"""On a CUDA machine: the engine wrapper and its scheduler stats work on the GPU build of vLLM.

Skipped without CUDA (the CPU CI machines). Run on a GPU host with: pytest -m gpu
"""

import asyncio

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_engine_generates_and_reports_stats_on_gpu():
    from fleetserve.platform.config import parse_config
    from fleetserve.platform.engine import Engine, SamplingOptions
    from fleetserve.platform.model_store import resolve_source

    model = parse_config({"models": [{"name": "smollm2", "source": "smollm2-135m-instruct", "resources": {"num_gpus": 1},
                                      "engine_args": {"dtype": "bfloat16", "max_model_len": 2048,
                                                      "kv_cache_memory_bytes": 2 * 2**30}}]}).models[0]
    engine = Engine.create(model, resolve_source(model.source))
    try:
        async def run() -> list:
            prompt = engine.render_chat([{"role": "user", "content": "What is the capital of France?"}])
            return [d async for d in engine.generate(prompt, SamplingOptions(max_tokens=16, temperature=0), "gpu-1")]

        deltas = asyncio.run(run())
        assert "Paris" in "".join(delta.text for delta in deltas)
        stats = engine.stats()
        assert stats.num_running == 0 and stats.kv_cache_usage == 0.0 and stats.num_generation_tokens >= 1
        # The config leaves max_num_seqs to vLLM, whose API-server default on any GPU is 256 or more (1024 on an
        # H100 or H200), where an engine outside that context gets 128.
        assert engine.max_num_seqs >= 256
    finally:
        engine.shutdown()
