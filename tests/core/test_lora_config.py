"""The lora: section: vLLM's LoRA limits, adapter names in the model namespace, and what it refuses."""

import json

import pytest

from factories import peft_folder
from fleetserve.platform.config import ConfigError, parse_config
from fleetserve.platform.openai_app import lora_module_flags


def config(lora: dict, **model_fields) -> dict:
    return {"models": [{"name": "base", "source": "x", "lora": lora, **model_fields}]}


def test_lora_limits_become_vllm_engine_kwargs():
    model = parse_config(config({"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4})).models[0]
    assert model.engine_kwargs() == {**model.engine_args.to_vllm_kwargs(), "enable_lora": True, "max_loras": 2,
                                     "max_lora_rank": 8, "max_cpu_loras": 4}


def test_configured_adapters_become_vllm_lora_modules_naming_their_base(tmp_path):
    peft_folder(tmp_path)
    model = parse_config(config({"adapters": [{"name": "base-sql", "source": str(tmp_path)}]})).models[0]
    flags = lora_module_flags(model, tmp_path)
    assert flags[0] == "--lora-modules"
    assert json.loads(flags[1]) == {"name": "base-sql", "path": str(tmp_path), "base_model_name": "base"}


def test_a_configured_adapter_vllm_would_refuse_is_a_config_error_naming_it(tmp_path):
    pytest.importorskip("vllm")
    folder = peft_folder(tmp_path, r=16)
    model = parse_config(config({"max_lora_rank": 8, "adapters": [{"name": "base-sql", "source": str(folder)}]}))
    # vLLM would refuse it only inside the engine, where it stopped the replica's whole app from building.
    with pytest.raises(ConfigError, match=r"models\[base\]\.lora\.adapters\[base-sql\]: adapter folder .*: "
                                          r"LoRA rank 16 is greater than max_lora_rank 8\."):
        lora_module_flags(model.models[0], tmp_path)


@pytest.mark.parametrize(("data", "expected"), [
    (config({"adapters": [{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]}), "adapters ['a'] appear twice"),
    (config({"max_loras": 4, "max_cpu_loras": 2}), "max_cpu_loras (2) must be at least max_loras (4)"),
    (config({"max_lora_rank": 12}), "max_lora_rank 12 is not one vLLM takes: one of 1, 8, 16, 32, 64, 128, 256, 320"),
    (config({"adapters": [{"name": "base", "source": "x"}]}), "'base' is the base model's own name"),
    (config({}, engine_args={"extra": {"max_loras": 3}}), "set LoRA limits in lora:"),
    ({"models": [{"name": "base", "source": "x", "lora": {"adapters": [{"name": "other", "source": "x"}]}},
                 {"name": "other", "source": "x"}]}, "model name 'other' appears twice"),
])
def test_lora_config_refused_with_a_reason(data, expected):
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert expected in str(caught.value)


def test_both_pools_of_a_disaggregated_model_serve_its_adapters():
    model = parse_config(config({"adapters": [{"name": "base-sql", "source": "x"}], "max_loras": 2},
                                disaggregation={"prefill": {}, "decode": {}})).models[0]
    for pool in ("prefill", "decode"):
        pool_model = model.pool_model(pool)
        assert pool_model.adapter_names == ["base-sql"]
        assert {key: pool_model.engine_kwargs()[key] for key in ("enable_lora", "max_loras")} == {
            "enable_lora": True, "max_loras": 2}


def test_tenants_may_name_adapters():
    parsed = parse_config({**config({"adapters": [{"name": "base-sql", "source": "x"}]}), "auth": {
        "tenants": {"a": {"models": ["base-sql"]}}, "api_keys": [{"sha256": "0" * 64, "tenant": "a"}]}})
    assert parsed.adapter_bases() == {"base-sql": "base"}


def test_the_ranks_taken_are_vllms():
    from typing import get_args

    pytest.importorskip("vllm")
    from vllm.config.lora import MaxLoRARanks

    from fleetserve.platform.config.lora import MAX_LORA_RANKS

    assert MAX_LORA_RANKS == get_args(MaxLoRARanks)
