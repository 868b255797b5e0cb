"""The vLLM frontend flags a model's `api:` section becomes, parsed by vLLM's own parser (no engine)."""

from pathlib import Path

import pytest

from fleetserve.platform.chat_templates import SMOLLM2_TOOLS
from fleetserve.platform.config import ConfigError, ModelConfig
from fleetserve.platform.openai_app import frontend_args, frontend_flags


def model(source: str = "unused", **api) -> ModelConfig:
    return ModelConfig(name="m", source=source, api=api)


def test_packaged_smollm2_gets_tools_template_and_hermes():
    assert frontend_flags(model("smollm2-135m-instruct")) == [
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--chat-template", SMOLLM2_TOOLS,
        "--enable-prompt-tokens-details"]


def test_the_config_overrides_packaged_defaults():
    flags = frontend_flags(model("smollm2-135m-instruct", tool_call_parser="llama3_json",
                                 enable_auto_tool_choice=False, enable_prompt_tokens_details=False))
    assert flags == ["--tool-call-parser", "llama3_json", "--chat-template", SMOLLM2_TOOLS]


def test_every_flag_reaches_vllms_parser():
    args = frontend_args(model(reasoning_parser="deepseek_r1", default_chat_template_kwargs={"thinking": False},
                               extra={"tool_strict_level": "parameter", "max_log_len": 100,
                                      "enable_request_id_headers": True}), Path("/models/m"))
    assert (args.model, args.served_model_name) == ("/models/m", ["m"])
    assert args.structured_outputs_config.reasoning_parser == "deepseek_r1"
    assert args.default_chat_template_kwargs == {"thinking": False}
    assert (args.tool_strict_level, args.max_log_len, args.enable_request_id_headers) == ("parameter", 100, True)
    assert args.enable_prompt_tokens_details and args.tool_call_parser is None


def test_a_flag_vllm_rejects_is_a_config_error_naming_the_model():
    with pytest.raises(ConfigError, match=r"models\[m\]\.api: vLLM rejects"):
        frontend_args(model(extra={"tool_strict_level": "lax"}), Path("/models/m"))


@pytest.mark.parametrize("extra", [{"max_model_len": 99}, {"served_model_name": "alias"}, {"model": "/models/x"}])
def test_an_engine_arg_in_the_api_section_is_a_config_error(extra):
    # vLLM's server parser takes engine args too, so each parsed before: max_model_len changed nothing (the
    # engine is built from engine_args), and served_model_name made the app answer to a name the engine lacks.
    with pytest.raises(ConfigError, match=rf"models\[m\]\.api\.extra: \['{next(iter(extra))}'\] are engine args, "
                                          r"which the api section cannot set: put them in engine_args"):
        frontend_args(model(extra=extra), Path("/models/m"))


def test_lora_modules_in_the_api_section_are_refused_naming_lora_adapters():
    from fleetserve.platform.config import parse_config

    # Before, the platform's own --lora-modules came last and vLLM's parser kept only those: these were dropped.
    with pytest.raises(ConfigError, match=r"lora_modules: adapters are lora\.adapters"):
        parse_config({"models": [{"name": "m", "source": "x", "api": {"extra": {"lora_modules": ["a=/a"]}}}]})


@pytest.mark.parametrize(("flag", "reason"), [
    ("api_server_count", "a replica runs one vLLM app over its engine"),
    ("headless", "a replica runs one vLLM app over its engine"),
    ("enable_tokenizer_info_endpoint", "an endpoint the front door does not forward"),
    ("enable_server_load_tracking", "an endpoint the front door does not forward"),
    ("config", "put its keys in engine_args and api"),
])
def test_a_flag_that_would_do_nothing_in_a_replica_is_refused_naming_why(flag, reason):
    from fleetserve.platform.config import parse_config

    # vLLM's parser takes each, and a replica's app never acts on it: accepted, it would do nothing.
    with pytest.raises(ConfigError, match=rf"{flag}: .*{reason}"):
        parse_config({"models": [{"name": "m", "source": "x", "api": {"extra": {flag: 2}}}]})
