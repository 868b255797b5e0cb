"""Builds the Ray Serve application from a platform config. The only module that calls ``.bind()``."""

from __future__ import annotations

import os
from typing import Any

from ray.serve import Application

from fleetserve.deployments.engine_server import EngineDeployment
from fleetserve.deployments.ingress import IngressDeployment
from fleetserve.deployments.metrics_hub import MetricsHubDeployment
from fleetserve.platform.config import ConfigError, PlatformConfig, parse_config
from fleetserve.platform.engine import plan_cpu_binding
from fleetserve.platform.model_store import resolve_source


def cpu_bindings_per_model(config: PlatformConfig, num_cores: int | None = None) -> dict[str, list[str] | None]:
    """Core bindings for each model's replicas, spreading all CPU engines over the host's cores.

    Models with an explicit ``resources.cpu_binding`` keep it; GPU models get none.
    """
    num_cores = num_cores or len(os.sched_getaffinity(0))
    auto = [model for model in config.models if model.resources.cpu_binding is None and not model.resources.num_gpus]
    plan = iter(plan_cpu_binding(sum(model.replicas for model in auto), num_cores))
    bindings: dict[str, list[str] | None] = {}
    for model in config.models:
        if model.resources.num_gpus:
            bindings[model.name] = None
        elif model.resources.cpu_binding is not None:
            bindings[model.name] = model.resources.cpu_binding
        else:
            bindings[model.name] = [next(plan) for _ in range(model.replicas)]
    return bindings


def build_app(config: PlatformConfig, resolve_locally: bool = True) -> Application:
    """The Serve application: one engine deployment per model behind one OpenAI ingress.

    Args:
        config: the platform config.
        resolve_locally: resolve (and convert) model sources here, once, and hand replicas the
            folder; False lets each replica resolve its own source (multi-node clusters).
    """
    bindings = cpu_bindings_per_model(config)
    hub = MetricsHubDeployment.bind()
    engines = {}
    for model in config.models:
        model_path = str(resolve_source(model.source)) if resolve_locally else None
        engines[model.name] = EngineDeployment.options(**model.deployment_options()).bind(
            model.model_dump(), bindings[model.name], model_path, hub)
    routing = config.model_routing.model_dump() if config.model_routing is not None else None
    return IngressDeployment.bind(engines, hub, {model.name: model.model_dump() for model in config.models}, routing)


def app_builder(args: dict[str, Any]) -> Application:
    """Serve application builder for config files (RayService serveConfigV2, ``serve run``).

    Args:
        args: ``{"platform": <platform config>}``, as the Helm chart writes it.
    """
    if "platform" not in args:
        raise ConfigError("application args need a 'platform' key holding the fleetserve platform config")
    return build_app(parse_config(args["platform"], origin="serve application args"))
