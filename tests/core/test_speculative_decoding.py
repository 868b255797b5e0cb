"""Speculative decoding on a real vLLM engine, without Ray: a draft named by a packaged id (which vLLM alone would
take for a Hub id) is fetched by the model store, drafts, and is counted under vLLM's metric names.

The draft is the target itself (the tiny random Llama in float32), so greedy verification accepts every draft
token: acceptance is exactly 1, and the output equals the engine's without speculation.
"""

from __future__ import annotations

from typing import Any

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from factories import model_entry
from fleetserve.deployments.engine_server import EngineServer
from fleetserve.platform.api_types import ApiRequest, Endpoint
from fleetserve.platform.config import ModelConfig

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NUM_SPECULATIVE_TOKENS = 2
MAX_TOKENS = 24
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def speculative_model(**spec: object) -> ModelConfig:
    return ModelConfig.model_validate(model_entry(speculative_config={
        "model": "tiny-random-llama", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, **spec}))


@pytest.fixture(scope="module")
def servers():
    started = {"plain": EngineServer(ModelConfig.model_validate(model_entry()), replica_id="plain", cpu_binding="0"),
               "speculative": EngineServer(speculative_model(), replica_id="spec", cpu_binding="1")}
    yield started
    for server in started.values():
        server.shutdown()


async def greedy_token_ids(server: EngineServer) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    status, data = await server.respond(ApiRequest("r", Endpoint.COMPLETIONS, json.dumps(body).encode()))
    assert status.status_code == 200, data
    return json.loads(data)["choices"][0]["token_ids"]


def samples(metrics: Any) -> dict[tuple[str, str], float]:
    """(sample name, position label) -> value, for the speculative decoding series."""
    return {(sample.name, sample.labels.get("position", "")): sample.value
            for family in text_string_to_metric_families(metrics.exposition().decode())
            if family.name.startswith("vllm:spec_decode") for sample in family.samples}


async def test_a_packaged_draft_drafts_and_every_token_of_a_draft_equal_to_its_target_is_accepted(servers):
    plain, speculative = servers["plain"], servers["speculative"]
    assert speculative.engine._llm.vllm_config.speculative_config.draft_model_config.model != "tiny-random-llama"
    assert samples(speculative.metrics)[("vllm:spec_decode_num_draft_tokens_total", "")] == 0  # zero from the start

    assert await greedy_token_ids(speculative) == await greedy_token_ids(plain)
    counts = samples(speculative.metrics)
    drafts = counts[("vllm:spec_decode_num_drafts_total", "")]
    # Every draft proposes NUM_SPECULATIVE_TOKENS tokens, and a draft model equal to its target has each accepted.
    assert drafts > 0
    assert counts[("vllm:spec_decode_num_draft_tokens_total", "")] == NUM_SPECULATIVE_TOKENS * drafts
    assert counts[("vllm:spec_decode_num_accepted_tokens_total", "")] == NUM_SPECULATIVE_TOKENS * drafts
    assert [counts[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))]
            for p in range(NUM_SPECULATIVE_TOKENS)] == [drafts] * NUM_SPECULATIVE_TOKENS
    assert samples(plain.metrics) == {}

