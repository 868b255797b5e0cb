"""Disaggregated serving: a model's prefill and decode pools."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fleetserve.platform.config.autoscaling import AutoscalingConfig, check_start_at_zero
from fleetserve.platform.config.base import Strict
from fleetserve.platform.config.routing import RoutingConfig

POOLS = ("colocated", "prefill", "decode")


class PoolConfig(Strict):
    """One phase's pool of a disaggregated model."""

    # Replicas in the pool (the initial count when autoscaling is set); 0 starts a pool that scales to zero
    # without a replica (a prefill pool is woken by the first prompt that finds it empty).
    replicas: int = Field(default=1, ge=0)
    # Overrides of the model's engine_args for this pool (e.g. a larger max_num_batched_tokens for prefill).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Cores per replica on CPU hosts, cycled over replicas; None spreads them with the other engines.
    cpu_binding: list[str] | None = None
    # Ray custom resources per replica of this pool, replacing the model's resources.custom_resources (e.g.
    # prefill on a mig-3g slice, decode on mig-1g slices, or each pool on its own node); None keeps the model's.
    custom_resources: dict[str, float] | None = None
    # Autoscaling for this pool; its ``pool`` is this pool's phase. None keeps ``replicas`` fixed.
    autoscaling: AutoscalingConfig | None = None
    # Replica routing inside the pool; None: the model's routing for prefill, least_loaded for decode.
    routing: RoutingConfig | None = None

    @model_validator(mode="after")
    def _check_start_at_zero(self) -> PoolConfig:
        check_start_at_zero(self.replicas, self.autoscaling, "pool")
        return self


class PDRatio(Strict):
    """Bounds on prefill replicas per decode replica. Each pool still scales on its own signals; one that
    falls below its share of the other is raised to it (never capped: a cap would hold back the pool
    whose load leads)."""

    # Prefill replicas at least this many per decode replica (the prefill pool is raised).
    min: float | None = Field(default=None, gt=0)
    # Prefill replicas at most this many per decode replica (the decode pool is raised).
    max: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> PDRatio:
        if self.min is None and self.max is None:
            raise ValueError("set min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) exceeds max ({self.max})")
        return self


class DisaggregationConfig(Strict):
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
    # While the prefill pool has no running replica (its node lost, its slice taken), Serve would queue each
    # prefill until one runs: prefill_locally serves the prompt on the decode replica instead (slower, but
    # served); refuse answers 503 at once.
    prefill_pool_empty: Literal["prefill_locally", "refuse"] = "prefill_locally"
    # Seconds a prefill engine keeps KV that no decode engine reads (its decode side died or gave up).
    kv_lease_s: int = Field(default=30, ge=1)
    # Keeps the autoscaled pools within a ratio of each other (both pools need autoscaling by a fleetserve
    # policy: Serve's own ray_default cannot read the other pool's count).
    pd_ratio: PDRatio | None = None
    # Microseconds NIXL's progress thread sleeps between polls. NIXL's default, 0, busy-polls a core per
    # engine: set 0 on GPU hosts with cores to spare for the lowest transfer latency.
    nixl_progress_delay_us: int = Field(default=500, ge=0)

    @model_validator(mode="after")
    def _ratio_needs_two_autoscaled_pools(self) -> DisaggregationConfig:
        if self.pd_ratio is None:
            return self
        for pool in ("prefill", "decode"):
            autoscaling = getattr(self, pool).autoscaling
            if autoscaling is None or autoscaling.policy == "ray_default":
                raise ValueError(f"pd_ratio bounds two pools autoscaled by a fleetserve policy; the {pool} pool "
                                 + ("has no autoscaling" if autoscaling is None else "uses ray_default"))
        return self
