"""A model's engine: vLLM's engine arguments, its OpenAI server options, and what a replica asks Ray for."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from fleetserve.platform.config.base import MiB, Strict, WithExtra

# Ray custom resources a worker group with a MIG profile advertises ("mig-3g.40gb": 1, the chart's
# rayStartParams), and a model pinned to that slice asks for.
RAY_MIG_RESOURCE_PREFIX = "mig-"
# Engine args that shape the KV cache's layout: a decode engine can only read KV written the same way.
KV_LAYOUT_ARGS = ("dtype", "block_size", "quantization", "max_model_len")


class EngineArgs(WithExtra):
    """vLLM engine arguments. The common ones are typed; ``extra`` passes anything else through."""

    _section: ClassVar[str] = "engine_args"

    # Longest prompt + output in tokens; None takes the model's own limit.
    max_model_len: int | None = Field(default=None, gt=0)
    # Weight and activation dtype. float32 makes greedy outputs reproducible on CPU.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # KV cache size in bytes. On CPU this is the whole KV pool; on GPU it replaces gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = Field(default=256 * MiB, gt=0)
    # Tokens per KV block; None lets vLLM choose for the platform.
    block_size: int | None = Field(default=None, gt=0)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Most sequences scheduled in one step.
    max_num_seqs: int | None = Field(default=None, gt=0)
    # Most tokens scheduled in one step (the prefill chunk size when chunked prefill is on).
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    quantization: str | None = None
    # Output tokens vLLM gathers into one streamed chunk after the first (vLLM's --stream-interval; None: 1).
    # Each chunk costs every process in front of the engine the same, whatever it holds, so 4 cuts their
    # per-token cost about 4x, at the price of tokens arriving in fours. A request may ask for more, not fewer.
    stream_interval: int | None = Field(default=None, ge=1)
    # GPUs (or, on CPU, groups of cores) one replica shards the model over, all on one node: vLLM's
    # multiprocessing executor runs one worker per rank, and the replica asks Ray for that many GPUs.
    tensor_parallel_size: int = Field(default=1, ge=1)
    # vLLM's speculative decoding config, passed through as is.
    speculative_config: dict[str, Any] | None = None
    seed: int = 0
    # Any other AsyncEngineArgs field; checked against vLLM when the engine is built.
    extra: dict[str, Any] = Field(default_factory=dict)

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``; unset optional fields are left out."""
        return {**self.model_dump(exclude={"extra"}, exclude_none=True), **self.extra}


_HTTP_SERVER = ("an option of the HTTP server `vllm serve` runs; a replica runs vLLM's app behind the platform's "
                "front door, which has its own in `server:`")
_LAUNCHER = ("an option of how `vllm serve` starts its processes; a replica runs one vLLM app over its engine, and "
             "Serve starts replicas: use replicas and autoscaling")
_NOT_FORWARDED = ("it adds an endpoint the front door does not forward (it forwards the OpenAI, Anthropic, pooling "
                  "and tokenize paths)")
# vLLM frontend flags that act on `vllm serve`'s own HTTP server or its outermost middleware, which an engine
# replica does not run, and why each is refused: accepted, they would do nothing (or, api_key, refuse every
# request the ingress forwards).
SERVER_OWNED_FLAGS = {
    "api_key": "API keys are checked at the front door: use the auth section",
    # The platform passes the configured adapters itself; a second list here would replace them.
    "lora_modules": "adapters are lora.adapters (or loaded at run time through /v1/load_lora_adapter)",
    **{flag: "CORS is answered at the front door: use server.cors"
       for flag in ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")},
    **{flag: _HTTP_SERVER for flag in (
        "host", "port", "uds", "grpc_port", "root_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
        "ssl_cert_reqs", "ssl_ciphers", "enable_ssl_refresh", "uvicorn_log_level", "disable_uvicorn_access_log",
        "disable_access_log_for_endpoints", "h11_max_incomplete_event_size", "h11_max_header_count",
        "disable_fastapi_docs", "enable_offline_docs", "data_parallel_supervisor_port")},
    **{flag: _LAUNCHER for flag in ("api_server_count", "headless", "grpc", "dp_supervisor_probe_failure_threshold",
                                    "dp_supervisor_probe_interval_s", "dp_supervisor_probe_timeout_s")},
    **{flag: _NOT_FORWARDED for flag in ("enable_server_load_tracking", "enable_tokenizer_info_endpoint",
                                         "enable_scale_out")},
    "config": "a file of `vllm serve` options: put its keys in engine_args and api",
    "model_tag": "the model is the model's source",
}


class ApiConfig(WithExtra):
    """vLLM's OpenAI server options for one model: what ``vllm serve`` takes as frontend flags."""

    _section: ClassVar[str] = "api"

    @field_validator("extra")
    @classmethod
    def _extra_is_not_the_servers(cls, extra: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(extra) & set(SERVER_OWNED_FLAGS))
        if owned:
            raise ValueError("; ".join(f"{flag}: {SERVER_OWNED_FLAGS[flag]}" for flag in owned))
        return extra

    # vLLM's --tool-call-parser (e.g. hermes, llama3_json); None takes the packaged model's default, if any.
    tool_call_parser: str | None = None
    # Lets the model decide when to call a tool (tool_choice "auto"); None: on when a tool parser is set.
    enable_auto_tool_choice: bool | None = None
    # A Jinja chat template, inline or a file path; None: the packaged model's default, else the model's own.
    chat_template: str | None = None
    # vLLM's --reasoning-parser (e.g. deepseek_r1, qwen3): splits reasoning from content.
    reasoning_parser: str | None = None
    # usage.prompt_tokens_details.cached_tokens (prefix-cache hits) in every response; vLLM's default is off.
    enable_prompt_tokens_details: bool = True
    # Keyword arguments every request's chat template gets unless the request sets them.
    default_chat_template_kwargs: dict[str, Any] | None = None
    # Any other vLLM frontend flag by its field name (e.g. {"max_log_len": 100}); checked by vLLM's parser.
    extra: dict[str, Any] = Field(default_factory=dict)


class Resources(Strict):
    """What one replica asks Ray for."""

    num_cpus: float = Field(default=0.5, ge=0)
    num_gpus: float = Field(default=0, ge=0)
    # Cores the replica's vLLM worker is pinned to (VLLM_CPU_OMP_THREADS_BIND), one entry per
    # replica rank, e.g. ["0", "1"]. None: fleetserve spreads all engines over the machine's cores.
    cpu_binding: list[str] | None = None
    # Ray accelerator_type, e.g. "H100"; None: any.
    accelerator_type: str | None = None
    # Ray custom resources per replica, e.g. {"mig-3g.40gb": 1} to land on a worker group's MIG slice.
    custom_resources: dict[str, float] = Field(default_factory=dict)
