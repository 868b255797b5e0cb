"""Routing: replica routing within a model (``routing:``) and routed model names (``model_routing:``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleetserve.platform.config.base import Strict


class RoutingConfig(Strict):
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


class ModelRoute(Strict):
    """A routed model name: a cost/quality router picks one of several served models per request."""

    # The name clients send as ``model``, e.g. "auto".
    name: str
    # random, mf, classifier, mlp or knn (see fleetserve.router.model.quality_router).
    router: Literal["random", "mf", "classifier", "mlp", "knn"]
    # Escalate to a stronger tier when its predicted win rate is at or above this (RouteLLM's threshold).
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    # Instead of a threshold: the share of traffic to send to the strongest tier, looked up in the
    # checkpoint's calibrations (``fleetserve router calibrate``).
    strong_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    # Served model names, cheapest first; None takes model_routing.tiers.
    tiers: list[str] | None = None
    # The checkpoint's model each tier stands for, in tier order; None maps them by strength order.
    checkpoint_models: list[str] | None = None
    # The tier for prompts farther from the router's training prompts than its checkpoint's domain
    # bound (the win rate there is an extrapolation); None trusts the win rate everywhere.
    out_of_domain_tier: str | None = None

    @model_validator(mode="after")
    def _one_bar(self) -> ModelRoute:
        if (self.threshold is None) == (self.strong_fraction is None):
            raise ValueError("set exactly one of threshold or strong_fraction")
        if self.name.startswith("router-"):
            raise ValueError("route names starting with 'router-' are reserved for router-<router>-<threshold>")
        return self


class RecordingConfig(Strict):
    """Where the ingress records routed prompts of tenants that opted in (auth.tenants.*.record_routed_prompts)."""

    # A folder, relative to the config file; each ingress process writes routed-<host>-<pid>.jsonl there,
    # rotated copies getting .1, .2, ... suffixes.
    directory: str
    # Size at which the live file is rotated.
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Rotated copies kept; older ones are deleted.
    num_backups: int = Field(default=5, ge=1)
    # With auth off there are no tenants to opt in: record every routed prompt as tenant "anonymous".
    anonymous: bool = False


class ModelRoutingConfig(Strict):
    """Cost/quality routing: model names that a router resolves to one of the served models."""

    # Router checkpoint folder per router kind (``fleetserve router train``); random needs none.
    checkpoints: dict[Literal["mf", "classifier", "mlp", "knn"], str] = Field(default_factory=dict)
    # Served models cheapest first, for RouteLLM-style names ``router-<router>-<threshold>`` and
    # routes without their own tiers.
    tiers: list[str] = Field(default_factory=list)
    # What the router reads: the last user message (RouteLLM), all user messages, or the whole chat.
    route_on: Literal["last_user", "all_user", "all"] = "last_user"
    routes: list[ModelRoute] = Field(default_factory=list)
    # Record routed prompts and feedback for `fleetserve router label` / `calibrate --records`; None records nothing.
    recording: RecordingConfig | None = None
