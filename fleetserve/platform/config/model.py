"""One served model: its source, engine, replicas, autoscaling, routing, prices and pools."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from fleetserve.platform.config.autoscaling import AutoscalingConfig, check_start_at_zero
from fleetserve.platform.config.base import ModelName, Strict
from fleetserve.platform.config.disaggregation import DisaggregationConfig, PoolConfig
from fleetserve.platform.config.engine import KV_LAYOUT_ARGS, RAY_MIG_RESOURCE_PREFIX, ApiConfig, EngineArgs, Resources
from fleetserve.platform.config.lora import LoraConfig
from fleetserve.platform.config.routing import RoutingConfig
from fleetserve.platform.model_store import HubFetch


# Serve's max_ongoing_requests for an engine replica whose config sets a small max_num_seqs: room for requests
# waiting in the engine as well as running.
DEFAULT_ONGOING_REQUESTS = 256
# The largest max_num_seqs vLLM 0.32 picks for an API server's engine where the config leaves it (H100, H200).
VLLM_MAX_DEFAULT_NUM_SEQS = 1024
# Engine args a replica's shape depends on, which the platform owns, and why each is refused in ``extra``.
PARALLELISM_OWNED = {
    "distributed_executor_backend": "the platform runs a replica's ranks with vLLM's multiprocessing executor",
    "pipeline_parallel_size": "a replica runs on one node; shard it with engine_args.tensor_parallel_size",
    "data_parallel_size": "scale data-parallel with replicas (or autoscaling), which the platform routes between",
}

# Engine args the platform sets on every engine, and why each is refused in ``extra`` (vLLM would get the key
# twice, and the replica would fail at start with a TypeError).
ENGINE_OWNED = {
    "model": "the platform gives vLLM the local folder of the model's source: set source",
    "served_model_name": "clients call the model by its name, and adapters by theirs: set name",
    "disable_log_stats": "the platform's metrics, admission control and autoscaling read every engine step's stats",
}
PLATFORM_OWNED = {**PARALLELISM_OWNED, **ENGINE_OWNED}

# Environment variables the platform sets in an engine replica's processes, and why each is refused in env_vars.
ENV_OWNED = {
    "VLLM_CPU_OMP_THREADS_BIND": "the platform pins each replica's worker to its cores: set resources.cpu_binding",
    "CUDA_VISIBLE_DEVICES": "Ray gives each replica its GPUs: set resources.num_gpus",
    **{name: "the platform sets it for the KV transfer between a disaggregated model's pools"
       for name in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "FLEETSERVE_NIXL_PROGRESS_DELAY_US")},
}
# Ray's and Serve's own settings are the cluster's, not one deployment's (server:, or the chart's extraEnv).
ENV_OWNED_PREFIX = "RAY_"


class ModelConfig(Strict):
    """One served model."""

    # The name clients send as ``model``.
    name: ModelName
    # A local HF folder, a .gguf file, or a packaged model id (see ``fleetserve.platform.model_store``).
    source: str
    # Replicas to run (the initial count when autoscaling is set; 0 starts a pool that scales to zero there).
    replicas: int = Field(default=1, ge=0)
    # Replica autoscaling; None keeps ``replicas`` fixed.
    autoscaling: AutoscalingConfig | None = None
    engine_args: EngineArgs = Field(default_factory=EngineArgs)
    # vLLM's OpenAI server options (tool calling, chat template, reasoning parser) in every replica.
    api: ApiConfig = Field(default_factory=ApiConfig)
    resources: Resources = Field(default_factory=Resources)
    # Environment variables of the model's replicas and the vLLM processes they start (vLLM's VLLM_* switches,
    # say VLLM_ALLOW_LONG_MAX_MODEL_LEN); applied through Serve's runtime_env, so a change restarts the replicas.
    env_vars: dict[str, str] = Field(default_factory=dict)
    # Requests one replica holds at once before Serve queues them in front of it; at least the engine's
    # max_num_seqs, or the engine never fills its batch. None: twice max_num_seqs, at least 256; where vLLM
    # picks max_num_seqs (up to 1024 on an H100), 2048.
    max_ongoing_requests: int | None = Field(default=None, gt=0)
    # Seconds a replica's engine may hold unfinished requests without finishing a step before the replica
    # counts as unhealthy and Serve replaces it: a hung kernel or collective neither dies nor errs. None: never.
    stall_timeout_s: float | None = Field(default=120.0, gt=0)
    # Failed replica starts (an engine that raised or died while starting) before Serve marks the pool failed and
    # `serve` or `apply` stops with the engine's error. None: Serve's default, 3 for each replica it starts; 1
    # reports a misconfigured engine after one start where a start takes minutes. Serve retries a replica at most
    # 3 times, so 3 is the most.
    max_start_failures: int | None = Field(default=None, ge=1, le=3)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    # Prices for cost estimates (fleetserve_estimated_cost_dollars), in dollars per 1M tokens.
    cost_per_million_input_tokens: float = Field(default=0.0, ge=0)
    cost_per_million_output_tokens: float = Field(default=0.0, ge=0)
    # Separate prefill and decode pools; None serves both phases on the same replicas (colocated).
    disaggregation: DisaggregationConfig | None = None
    # LoRA adapters of this base model, each served as a model name; None serves the base alone.
    lora: LoraConfig | None = None
    # Which pool this config describes; set by pool_model() for a disaggregated model's pools.
    _pool: str = PrivateAttr(default="colocated")

    @model_validator(mode="after")
    def _check_start_at_zero(self) -> ModelConfig:
        check_start_at_zero(self.replicas, self.autoscaling, "model")
        return self

    @model_validator(mode="after")
    def _check_platform_owned(self) -> ModelConfig:
        _check_not_platform_owned(self.engine_args.extra, "engine_args.extra")
        return self

    @model_validator(mode="after")
    def _check_env_vars(self) -> ModelConfig:
        for name in self.env_vars:
            if name in ENV_OWNED:
                raise ValueError(f"env_vars.{name}: {ENV_OWNED[name]}")
            if name.startswith(ENV_OWNED_PREFIX):
                raise ValueError(f"env_vars.{name}: Ray's and Serve's settings are the cluster's, not one model's "
                                 f"(server:, or the Helm chart's extraEnv)")
        return self

    @model_validator(mode="after")
    def _check_revisions(self) -> ModelConfig:
        # The store fetches one revision into one folder, which vLLM then reads weights, code and tokenizer from.
        # A tokenizer of its own (engine_args.extra.tokenizer) comes at its own revision.
        own_tokenizer = self.engine_args.extra.get("tokenizer") is not None
        for key in ("code_revision",) if own_tokenizer else ("tokenizer_revision", "code_revision"):
            value = self.engine_args.extra.get(key)
            if value is not None and value != self.source_revision:
                raise ValueError(f"engine_args.extra.{key}: the model's files come from one revision of its source "
                                 f"(engine_args.extra.revision, {self.source_revision or 'the default branch'}); "
                                 f"set revision instead")
        return self

    @model_validator(mode="after")
    def _check_kv_events(self) -> ModelConfig:
        pools = [self.disaggregation.prefill, self.disaggregation.decode] if self.disaggregation else []
        routings = [self.routing, *(pool.routing for pool in pools if pool.routing is not None)]
        if all(routing.prefix_source != "kv_events" for routing in routings):
            return self
        if self.engine_args.enable_prefix_caching is False:
            raise ValueError("routing.prefix_source kv_events needs engine_args.enable_prefix_caching")
        if "kv_events_config" in self.engine_args.extra:
            raise ValueError("engine_args.extra.kv_events_config: the platform sets it for "
                             "routing.prefix_source kv_events; remove it")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> ModelConfig:
        if self.lora is None:
            return self
        if any(key in self.engine_args.extra for key in self.lora.engine_kwargs()):
            raise ValueError(f"engine_args.extra: set LoRA limits in lora:, not "
                             f"{sorted(set(self.engine_args.extra) & set(self.lora.engine_kwargs()))}")
        if self.name in self.adapter_names:
            raise ValueError(f"lora.adapters: {self.name!r} is the base model's own name")
        return self

    @model_validator(mode="after")
    def _check_parallelism(self) -> ModelConfig:
        num_ranks = self.engine_args.tensor_parallel_size
        if num_ranks == 1:
            return self
        if self.resources.num_gpus and self.resources.num_gpus != num_ranks:
            raise ValueError(f"resources.num_gpus is {self.resources.num_gpus:g}, but engine_args.tensor_parallel_size "
                             f"{num_ranks} needs one GPU per rank: set num_gpus to {num_ranks}")
        if self.disaggregation is not None:
            raise ValueError("engine_args.tensor_parallel_size above 1 is not supported for disaggregated models yet")
        slices = sorted(name for name in self.resources.custom_resources if name.startswith(RAY_MIG_RESOURCE_PREFIX))
        if slices:
            # No peer path between MIG instances for the ranks' all-reduces (docs/architecture.md).
            raise ValueError(f"engine_args.tensor_parallel_size {num_ranks} cannot run on MIG slices "
                             f"({', '.join(slices)}): tensor parallelism needs whole GPUs")
        for binding in self.resources.cpu_binding or []:
            if len(binding.split("|")) not in (1, num_ranks):
                raise ValueError(f"resources.cpu_binding entry {binding!r} binds {len(binding.split('|'))} ranks; "
                                 f"tensor_parallel_size {num_ranks} takes one core set per rank joined by '|' "
                                 f"(e.g. '0-3|4-7'), or one set the platform splits between them")
        return self

    @property
    def adapter_names(self) -> list[str]:
        """The names of the adapters configured under this base (empty without lora)."""
        return [adapter.name for adapter in self.lora.adapters] if self.lora is not None else []

    @property
    def schedules_by_priority(self) -> bool:
        """Whether the engines order their queue by request priority (vLLM's scheduling_policy ``priority``)."""
        return self.engine_args.extra.get("scheduling_policy") == "priority"

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``: the engine args plus the LoRA limits."""
        return {**self.engine_args.to_vllm_kwargs(), **(self.lora.engine_kwargs() if self.lora else {})}

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
        _check_no_kv_offloading(self.engine_args.extra, "engine_args.extra")
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
            _check_no_kv_offloading(pool.engine_args.get("extra") or {}, f"{where}.engine_args.extra")
            _check_not_platform_owned(args.extra, f"{where}.engine_args.extra")
            layouts[phase] = {key: getattr(args, key) for key in KV_LAYOUT_ARGS}
            if pool.autoscaling is not None and pool.autoscaling.pool not in ("colocated", phase):
                raise ValueError(f"{where}.autoscaling.pool is {pool.autoscaling.pool!r}; this pool is {phase!r}")
        differ = {key: (layouts["prefill"][key], layouts["decode"][key]) for key in KV_LAYOUT_ARGS
                  if layouts["prefill"][key] != layouts["decode"][key]}
        if differ:
            raise ValueError(f"disaggregation: prefill and decode engine_args must agree on the KV layout; "
                             f"they differ in {differ} (prefill, decode)")
        return self

    @model_validator(mode="after")
    def _check_ongoing_requests(self) -> ModelConfig:
        for pool in self.pools():
            seqs = self.pool_model(pool).engine_args.max_num_seqs
            if self.max_ongoing_requests is not None and seqs is not None and self.max_ongoing_requests < seqs:
                raise ValueError(f"max_ongoing_requests {self.max_ongoing_requests} is below the {pool} engine's "
                                 f"max_num_seqs {seqs}: Serve would never send it more, and its batch would never "
                                 f"fill; lower engine_args.max_num_seqs instead")
        return self

    @property
    def ongoing_requests_limit(self) -> int:
        """Requests one replica holds at once (Serve's max_ongoing_requests): the config's, else twice the engine's
        max_num_seqs (at least 256), else twice the largest max_num_seqs vLLM picks for an API server (1024)."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        seqs = self.engine_args.max_num_seqs
        return max(DEFAULT_ONGOING_REQUESTS, 2 * seqs) if seqs is not None else 2 * VLLM_MAX_DEFAULT_NUM_SEQS

    @model_validator(mode="after")
    def _check_gpu_share(self) -> ModelConfig:
        share = self.resources.num_gpus
        if not 0 < share < 1:
            return self
        for pool in self.pools():
            utilization = self.pool_model(pool).engine_args.extra.get("gpu_memory_utilization")
            if isinstance(utilization, (int, float)) and utilization > share:
                where = "" if pool == "colocated" else f"disaggregation.{pool}."
                raise ValueError(f"{where}engine_args.extra.gpu_memory_utilization {utilization:g} is more than "
                                 f"resources.num_gpus {share:g}: Ray packs replicas on parts of a GPU onto one GPU, "
                                 f"and vLLM's utilization is each engine's part of the whole GPU, so the next engine "
                                 f"there would not start. Set it at most {share:g}, or leave it out for {share:g} x "
                                 f"vLLM's default")
        return self

    @property
    def source_revision(self) -> str | None:
        """The Hub revision ``engine_args.extra.revision`` pins the source to; None: its default branch."""
        return self.engine_args.extra.get("revision")

    @property
    def hub_fetch(self) -> HubFetch:
        """How the store fetches a Hub source: vLLM's revision, hf_token and download_dir engine args, which vLLM
        itself ignores once the source is a local folder."""
        extra = self.engine_args.extra
        return HubFetch(self.source_revision, extra.get("hf_token"), extra.get("download_dir"))

    @property
    def draft_source(self) -> str | None:
        """The source of the speculative decoding draft's weights (``engine_args.speculative_config.model``); None
        where there are none: no speculative decoding, drafts from the prompt (ngram, suffix), a class to load."""
        spec = self.engine_args.speculative_config or {}
        method, source = spec.get("method"), spec.get("model")
        if not isinstance(source, str) or method in ("suffix", "custom_class") or str(method).startswith("ngram"):
            return None
        return source

    @property
    def draft_hub_fetch(self) -> HubFetch:
        """How the store fetches a Hub draft: its own revision (``speculative_config.revision``), the model's token
        and download folder."""
        hub = self.hub_fetch
        return HubFetch((self.engine_args.speculative_config or {}).get("revision"), hub.token, hub.cache_dir)

    def with_draft_path(self, path: str) -> ModelConfig:
        """A copy whose speculative decoding draft is read from the local folder ``path``."""
        copy = self.model_copy(deep=True)
        copy.engine_args.speculative_config = {**(copy.engine_args.speculative_config or {}), "model": path}
        return copy

    @property
    def max_serving_replicas(self) -> int:
        """Most replicas that answer the ingress (colocated, or the decode pool): the autoscaling maximum."""
        serving = self.serving_model()
        return serving.autoscaling.max_replicas if serving.autoscaling is not None else serving.replicas

    @property
    def pool(self) -> str:
        """colocated, or the phase (prefill, decode) of a pool config from ``pool_model``."""
        return self._pool

    def pools(self) -> tuple[str, ...]:
        """The pools this model runs: colocated, or prefill and decode."""
        return ("colocated",) if self.disaggregation is None else ("prefill", "decode")

    @property
    def serving_pool(self) -> str:
        """The pool whose replicas answer the ingress and stream the response: decode when disaggregated."""
        return "decode" if self.disaggregation is not None else "colocated"

    def serving_model(self) -> ModelConfig:
        """This model's config for its serving pool (``serving_pool``)."""
        return self.pool_model(self.serving_pool)

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
        overrides = {"cpu_binding": spec.cpu_binding, "custom_resources": spec.custom_resources}
        resources = self.resources.model_copy(update={key: value for key, value in overrides.items()
                                                      if value is not None})
        engine_args = EngineArgs.model_validate({**self.engine_args.model_dump(), **spec.engine_args})
        copy = self.model_copy(update={"replicas": spec.replicas, "autoscaling": autoscaling, "routing": routing,
                                       "resources": resources, "engine_args": engine_args})
        copy._pool = pool
        return copy

    def request_cost(self, num_input_tokens: int, num_output_tokens: int) -> float:
        """Estimated dollars for one request at this model's prices."""
        return (num_input_tokens * self.cost_per_million_input_tokens
                + num_output_tokens * self.cost_per_million_output_tokens) / 1e6


def _check_no_kv_offloading(extra: dict[str, Any], where: str) -> None:
    """Refuses vLLM's KV offloading on a disaggregated model: vLLM replaces whatever KV connector is set with its
    offloading connector (VllmConfig._post_init_kv_transfer_config), so the platform's NIXL connector would be
    gone and no KV would reach the decode pool."""
    for key in ("kv_offloading_size", "kv_offloading_backend"):
        if extra.get(key) is not None:
            raise ValueError(f"{where}.{key}: vLLM's KV offloading replaces the NIXL connector that moves KV from "
                             f"prefill to decode engines; offload KV on a colocated model, or remove it")


def _check_not_platform_owned(extra: dict[str, Any], where: str) -> None:
    """Refuses an engine arg in ``extra`` that the platform sets itself (``PLATFORM_OWNED``), with the reason."""
    owned = sorted(set(extra) & PLATFORM_OWNED.keys())
    if owned:
        raise ValueError(f"{where}.{owned[0]}: {PLATFORM_OWNED[owned[0]]}")
