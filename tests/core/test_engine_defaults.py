"""The scheduler limits a replica's engine gets where the config leaves them to vLLM: those `vllm serve` gets.

vLLM sizes ``max_num_seqs`` and ``max_num_batched_tokens`` by the hardware only for an API server's usage context
(1024 and 8192 on an H100); an engine built in any other context gets 128 and 2048 on every device. On CPU the
API server's defaults grow with the ranks, which tells the two apart here without a GPU. No engine starts: the
engine args the replica builds are turned into vLLM's config as AsyncLLM would turn them.
"""

from __future__ import annotations

import os

import pytest

from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import Engine
from fleetserve.platform.model_store import resolve_source
from tests.factories import model_entry


class StubLLM:
    def get_tokenizer(self) -> None:
        return None


@pytest.fixture
def built_args(monkeypatch):
    """What Engine.create hands vLLM: its engine args and usage context, captured instead of starting an engine."""
    from vllm.v1.engine.async_llm import AsyncLLM

    captured = {}

    def from_engine_args(args, usage_context, stat_loggers):
        captured.update(args=args, usage_context=usage_context)
        return StubLLM()

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(from_engine_args))
    monkeypatch.setattr(os, "environ", dict(os.environ))  # Engine.create sets the worker's env for its spawn
    return captured


def scheduler_limits(captured: dict, **engine_args) -> tuple[int, int]:
    model = ModelConfig(**model_entry(**engine_args))
    Engine.create(model, resolve_source(model.source))
    config = captured["args"].create_engine_config(captured["usage_context"])
    return config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens


def test_engine_gets_the_api_servers_defaults_when_the_config_leaves_them(built_args):
    # vLLM's API-server defaults on CPU, per rank times the ranks: 2 x 128 sequences and 2 x 2048 tokens a step
    # (an engine context would give 128 and 2048).
    limits = scheduler_limits(built_args, tensor_parallel_size=2, max_num_seqs=None)
    assert limits == (256, 4096)


def test_engine_keeps_the_configs_limits(built_args):
    limits = scheduler_limits(built_args, tensor_parallel_size=2, max_num_seqs=16, max_num_batched_tokens=512)
    assert limits == (16, 512)
