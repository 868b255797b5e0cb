"""Serve options from the platform config: the adapters Serve instantiates rebuild exactly the policy the
config describes (Serve's kwargs cross as JSON)."""

from __future__ import annotations

import json

import pytest

from factories import RecordingHandle
from fleetserve.autoscaler.policy import KVCachePolicy, QueueDepthPolicy
from fleetserve.autoscaler.serve_adapter import ServeAutoscalingPolicy
from fleetserve.deployments.serve_options import deployment_options
from fleetserve.platform.config import ServerConfig, parse_config
from fleetserve.router.replica.policy import CacheAwarePolicy, CacheAwareThresholds
from fleetserve.router.replica.serve_adapter import FleetserveRequestRouter


def model(**fields):
    return parse_config({"models": [{"name": "m", "source": "x", **fields}]}).models[0]


@pytest.mark.parametrize(("autoscaling", "policy_class"), [
    ({"policy": "kv_cache", "target_high": 0.6, "max_replicas": 3, "pool": "decode"}, KVCachePolicy),
    ({"policy": "queue_depth", "target_queue_per_replica": 8, "max_step_up": 4}, QueueDepthPolicy),
])
def test_serve_instantiates_the_configured_autoscaling_policy(autoscaling, policy_class):
    config = model(autoscaling=autoscaling)
    policy = deployment_options(config, ServerConfig())["autoscaling_config"]["policy"]
    kwargs = json.loads(json.dumps(policy["policy_kwargs"]))  # Serve requires JSON-serializable kwargs
    adapter = policy["policy_function"](**kwargs)
    assert isinstance(adapter, ServeAutoscalingPolicy) and isinstance(adapter.policy, policy_class)
    assert adapter.config == config.autoscaling and adapter.model == "m"


def test_ray_default_is_serves_own_policy_with_its_knobs():
    options = deployment_options(model(autoscaling={"policy": "ray_default", "target_ongoing_requests": 8,
                                                    "max_replicas": 5}), ServerConfig())["autoscaling_config"]
    assert "policy" not in options
    assert (options["target_ongoing_requests"], options["max_replicas"], options["upscale_delay_s"]) == (8, 5, 30)


def test_serve_instantiates_the_configured_request_router():
    routing = {"policy": "cache_aware", "cache_threshold": 0.25, "balance_abs_threshold": 4}
    router_config = deployment_options(model(routing=routing), ServerConfig())["request_router_config"]
    assert router_config["request_router_class"] is FleetserveRequestRouter
    router = FleetserveRequestRouter.__new__(FleetserveRequestRouter)
    router.initialize_state(**json.loads(json.dumps(router_config["request_router_kwargs"])))
    assert isinstance(router.policy, CacheAwarePolicy)
    # balance_rel_threshold unset: routing:'s default, 1.5.
    assert router.policy.thresholds == CacheAwareThresholds(4, 1.5, 0.25)


def test_ingress_and_hub_go_where_server_custom_resources_say():
    from fleetserve.deployments.serve_options import control_actor_options, ingress_options

    config = parse_config({"models": [{"name": "m", "source": "x"}],
                           "server": {"custom_resources": {"node:__internal_head__": 0.001},
                                      "serve_fast_path": False}})
    assert control_actor_options(config.server) == {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}
    assert ingress_options(config.limits, config.server)["ray_actor_options"] == control_actor_options(config.server)
    # Without it, no resources: Ray places them on any node.
    assert control_actor_options(ServerConfig(serve_fast_path=False)) == {"num_cpus": 0}


def test_every_deployment_runs_on_serves_fast_path_when_turned_on():
    from fleetserve.deployments.serve_options import FAST_PATH_ENV, control_actor_options, serve_runtime_env

    on, off = ServerConfig(serve_fast_path=True), ServerConfig()
    # gRPC between Serve's processes (of the throughput-optimized options, the one that pays here), HAProxy
    # as the HTTP front door, and a stopping ingress replica reachable behind it for 5 s, not Ray's 30 s.
    assert serve_runtime_env(on) == {"env_vars": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
                                                  "RAY_SERVE_ENABLE_HA_PROXY": "1",
                                                  "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}}
    assert control_actor_options(on) == {"num_cpus": 0, "runtime_env": {"env_vars": FAST_PATH_ENV}}
    assert deployment_options(model(), on)["ray_actor_options"]["runtime_env"] == {"env_vars": FAST_PATH_ENV}
    assert serve_runtime_env(off) == {}
    assert "runtime_env" not in deployment_options(model(), off)["ray_actor_options"]


def test_a_local_cluster_moves_only_the_haproxy_ports_another_process_holds(monkeypatch):
    import socket

    from fleetserve.deployments import serve_options

    held, free = socket.socket(), socket.socket()
    with held, free:
        held.bind(("0.0.0.0", 0))
        held.listen()
        free.bind(("0.0.0.0", 0))
        free_port = free.getsockname()[1]
        free.close()  # a port known to have been free a moment ago
        monkeypatch.setattr(serve_options, "HAPROXY_PORT_ENV", {"RAY_SERVE_HAPROXY_STATS_PORT": held.getsockname()[1],
                                                                "RAY_SERVE_HAPROXY_METRICS_PORT": free_port})
        env = serve_options.job_runtime_env(ServerConfig(serve_fast_path=True))["env_vars"]
        # The held port's variable points elsewhere, at a port free when chosen; the free one keeps Ray's default.
        assert set(env) == {*serve_options.FAST_PATH_ENV, *serve_options.CONTROLLER_ENV, "RAY_SERVE_HAPROXY_STATS_PORT"}
        assert int(env["RAY_SERVE_HAPROXY_STATS_PORT"]) not in (held.getsockname()[1], 0)
        # Off the fast path there is no HAProxy: nothing to move.
        assert serve_options.job_runtime_env(ServerConfig()) == {"env_vars": serve_options.CONTROLLER_ENV}
        # Another cluster's HAProxy ports are that cluster's to choose.
        assert set(serve_options.job_runtime_env(ServerConfig(serve_fast_path=True), local_cluster=False)[
            "env_vars"]) == {*serve_options.FAST_PATH_ENV, *serve_options.CONTROLLER_ENV}


@pytest.mark.parametrize("grpc", [True, False])
def test_data_path_handles_take_the_calling_replicas_transport(monkeypatch, grpc):
    import ray.serve._private.constants as serve_constants

    from fleetserve.deployments.disaggregated.decode_server import HandlePrefillClient
    from fleetserve.deployments.ingress.model_clients import HandleModelClient

    # The replica's own environment says gRPC (or not); a handle bound in the driver carries the driver's.
    monkeypatch.setattr(serve_constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT", grpc)
    engine, prefill = RecordingHandle(), RecordingHandle(deployment_name="prefill-tiny")
    HandleModelClient(engine)
    HandlePrefillClient(prefill)
    # Streams to the engine and prefill calls go by gRPC exactly when the process is on the fast path; the
    # engine's adapter changes (control path, rare) keep Serve's default.
    assert engine.option_calls == [{"stream": True, "_by_reference": not grpc}, {"stream": False}]
    assert prefill.option_calls == [{"_by_reference": not grpc}]


def test_the_ingress_runs_as_many_replicas_as_the_config_says():
    from fleetserve.deployments.serve_options import ingress_options

    config = parse_config({"models": [{"name": "m", "source": "x"}], "server": {"num_ingress_replicas": 2}})
    assert ingress_options(config.limits, config.server)["num_replicas"] == 2
    assert ingress_options(config.limits, ServerConfig())["num_replicas"] == 1


def test_stopping_replicas_drain_for_the_configured_time():
    from fleetserve.deployments.serve_options import ingress_options

    # 300 s by default, where Serve's own 20 s cut any longer generation when a replica stopped.
    assert deployment_options(model(), ServerConfig())["graceful_shutdown_timeout_s"] == 300
    config = parse_config({"models": [{"name": "m", "source": "x"}], "server": {"drain_timeout_s": 45}})
    assert deployment_options(config.models[0], config.server)["graceful_shutdown_timeout_s"] == 45
    assert ingress_options(config.limits, config.server)["graceful_shutdown_timeout_s"] == 45


def test_max_start_failures_becomes_serves_constructor_retry_count():
    assert deployment_options(model(max_start_failures=1), ServerConfig())["max_constructor_retry_count"] == 1
    # Unset, Serve keeps its own count (3 per replica it starts).
    assert "max_constructor_retry_count" not in deployment_options(model(), ServerConfig())


@pytest.mark.parametrize("value", [0, 4])
def test_max_start_failures_outside_what_serve_retries_is_refused(value):
    from fleetserve.platform.config import ConfigError

    with pytest.raises(ConfigError, match=r"models\.0\.max_start_failures: Input should be"):
        model(max_start_failures=value)
