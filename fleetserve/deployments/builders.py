"""Builds the Ray Serve application from a platform config. The only module that calls ``.bind()``."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ray.serve import Application
from ray.serve.deployment import Deployment

from fleetserve.deployments.app_layout import AppLayout
from fleetserve.deployments.batches.server import BatchDeployment
from fleetserve.deployments.disaggregated.decode_server import DecodeDeployment
from fleetserve.deployments.disaggregated.prefill_server import PrefillDeployment
from fleetserve.deployments.engine_server import EngineDeployment
from fleetserve.deployments.ingress.server import IngressDeployment
from fleetserve.deployments.metrics_hub import HUB_DEPLOYMENT, MetricsHubDeployment
from fleetserve.deployments.serve_options import (DeploymentRef, control_actor_options, deployment_name,
                                                  deployment_options, ingress_options, serve_runtime_env)
from fleetserve.platform.config import (ConfigError, ModelConfig, PlatformConfig, ServerConfig, parse_config,
                                        serve_safe)
from fleetserve.platform.engine import Engine, plan_cpu_binding
from fleetserve.platform.model_store import resolve_source, with_local_draft
from fleetserve.platform.openai_app import chat_template_text


def cpu_bindings_per_deployment(config: PlatformConfig, num_cores: int | None = None) -> dict[str, list[str] | None]:
    """Core bindings for each engine deployment's replicas (every pool of every model), spreading all
    CPU engines over the host's cores.

    Pools with an explicit ``cpu_binding`` keep it; GPU models get none.
    """
    num_cores = num_cores or len(os.sched_getaffinity(0))
    pools = [model.pool_model(pool) for model in config.models for pool in model.pools()]
    auto = [pool for pool in pools if pool.resources.cpu_binding is None and not pool.resources.num_gpus]
    # Each tensor-parallel rank is a worker of its own: it gets a share of the cores as an engine would.
    # A pool that starts at zero still gets cores for the replica that wakes it.
    plan = iter(plan_cpu_binding(sum(max(pool.replicas, 1) * pool.engine_args.tensor_parallel_size for pool in auto),
                                 num_cores))
    bindings: dict[str, list[str] | None] = {}
    for pool in pools:
        if pool.resources.num_gpus:
            bindings[deployment_name(pool)] = None
        elif pool.resources.cpu_binding is not None:
            bindings[deployment_name(pool)] = pool.resources.cpu_binding
        else:
            num_ranks = pool.engine_args.tensor_parallel_size
            bindings[deployment_name(pool)] = ["|".join(next(plan) for _ in range(num_ranks))
                                               for _ in range(max(pool.replicas, 1))]
    return bindings


def deployment_version(*parts: Any) -> str:
    """Serve's version of a deployment: a hash of what shapes its replicas.

    Deployed again (``fleetserve apply``), Serve keeps the replicas of a deployment whose version is
    unchanged, and updates its replica count and autoscaling in place; a deployment without a version gets a
    new random one every time, so Serve would restart every engine.
    """
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def versioned(deployment: Deployment, version: str) -> Deployment:
    """The deployment with Serve's version set.

    Ray 2.60 refuses ``version`` from users (it versions deployments itself: ``serve.run`` with a random
    version each time, the declarative API with the application's code version) and accepts it only from
    its own builder, through ``_internal``; Ray is pinned, and tests/serving/test_apply_served.py fails if
    a kept model's replica restarts.
    """
    return deployment.options(version=version, _internal=True)


def _engine_version(model: ModelConfig, bindings: dict[str, list[str] | None], model_path: str | None,
                    engine_cls: type[Engine], server: ServerConfig) -> str:
    # Replica counts and autoscaling are Serve options it changes without a restart; LoRA adapters reach
    # running replicas through the hub's registry; other models' core bindings are theirs; Serve's fast path
    # is set in a replica's environment as it starts.
    shape = model.model_dump(mode="json", exclude={"replicas": True, "autoscaling": True, "lora": {"adapters"}})
    own = {name: bindings[name] for name in (deployment_name(model.pool_model(pool)) for pool in model.pools())}
    return deployment_version(shape, own, model_path, f"{engine_cls.__module__}.{engine_cls.__qualname__}",
                              serve_runtime_env(server))


def _engine_deployment(model: ModelConfig, bindings: dict[str, list[str] | None], model_path: str | None,
                       hub: Any, engine_cls: type[Engine], server: ServerConfig) -> Application:
    """The deployment the ingress calls for ``model``: its engine, or its decode pool behind a prefill pool."""
    version = _engine_version(model, bindings, model_path, engine_cls, server)
    if model.disaggregation is None:
        return versioned(EngineDeployment.options(**pool_options(model, model_path, server)), version).bind(
            model, bindings[deployment_name(model)], model_path, hub, engine_cls)
    prefill, decode = model.pool_model("prefill"), model.pool_model("decode")
    prefill_app = versioned(PrefillDeployment.options(**pool_options(prefill, model_path, server)), version).bind(
        model, bindings[deployment_name(prefill)], model_path, hub, engine_cls)
    return versioned(DecodeDeployment.options(**pool_options(decode, model_path, server)), version).bind(
        model, bindings[deployment_name(decode)], model_path, hub, prefill_app, engine_cls)


def pool_options(model: ModelConfig, model_path: str | None, server: ServerConfig) -> dict[str, Any]:
    """One pool's Serve options; a router that follows the engines' KV events also gets their tokenizer."""
    options = deployment_options(model, server)
    if model.routing.prefix_source == "kv_events":
        # The router tokenizes prompts as the engines do, to match the blocks their events describe.
        router_kwargs = options["request_router_config"]["request_router_kwargs"]
        # Not the hub token: Serve shows its router kwargs; the router reads HF_TOKEN.
        tokenizer = model.engine_args.extra.get("tokenizer")
        if tokenizer is not None:  # the engines' own (a folder beside the config, or a Hub id at its revision)
            router_kwargs["tokenizer_source"] = tokenizer
            router_kwargs["tokenizer_revision"] = model.engine_args.extra.get("tokenizer_revision")
        else:
            router_kwargs["tokenizer_source"] = model_path or model.source
            router_kwargs["tokenizer_revision"] = None if model_path else model.source_revision
        router_kwargs["chat_template"] = chat_template_text(model)
    return options


def build_app(config: PlatformConfig, resolve_locally: bool = True, engine_cls: type[Engine] = Engine) -> Application:
    """The Serve application: one engine deployment per model (or a prefill and a decode deployment for a
    disaggregated model) behind one OpenAI ingress.

    Args:
        config: the platform config.
        resolve_locally: resolve (and convert) model sources here, once, and hand replicas the
            folder (a cluster on this machine alone); False lets each replica resolve its own source on its
            own node (a cluster that was joined, whose nodes need not share this machine's files).
        engine_cls: every replica's engine class (``InstantEngine`` measures the serving path alone;
            tests inject fakes).
    """
    bindings = cpu_bindings_per_deployment(config)
    adapters = {model.name: {adapter.name: adapter.source for adapter in model.lora.adapters}
                for model in config.models if model.lora is not None}
    hub_options = control_actor_options(config.server)
    # Adapters reach a running hub through Serve's user_config (its reconfigure), not a new version, so a
    # change of adapters alone keeps the hub's registry, and with it the adapters loaded at run time.
    hub = versioned(MetricsHubDeployment.options(ray_actor_options=hub_options, user_config={"adapters": adapters}),
                    deployment_version(hub_options)).bind(adapters)
    engines = {}
    for model in config.models:
        model_path = None
        if resolve_locally:
            model_path = str(resolve_source(model.source, hub=model.hub_fetch))
            model = with_local_draft(model)
        engines[model.name] = _engine_deployment(model, bindings, model_path, hub, engine_cls, config.server)
    # Configs cross .bind() as the validated objects themselves (Ray pickles them), not re-validated dicts.
    ingress = versioned(IngressDeployment.options(**ingress_options(config.limits, config.server)),
                        deployment_version(config.model_dump(mode="json")))
    layout = AppLayout.DRIVER_SOURCES if resolve_locally else AppLayout.REPLICA_SOURCES
    return ingress.bind(engines, hub, {model.name: model for model in config.models}, config.model_routing,
                        config.auth, config.limits, config, layout, _batch_service(config))


def _batch_service(config: PlatformConfig) -> Application | None:
    """The Batch API's service, when the config turns it on; it keeps its files and runs its batches across
    changes to anything else."""
    if config.batches is None:
        return None
    options = control_actor_options(config.server)
    version = deployment_version(config.batches.model_dump(mode="json"), config.server.host, config.server.port,
                                 options)
    return versioned(BatchDeployment.options(ray_actor_options=options), version).bind(config.batches, config.server)


# The applications of a multi-application deployment (the chart's serveConfigV2): the front door on "/", the
# metrics hub, and one per model (``model_app_name``). Serve's declarative API versions every deployment of an
# application by that application's args, so a model in an application of its own restarts only when its own
# config changes; in one application, any change to the platform restarted every model.
FRONT_APP = "fleetserve"
HUB_APP = "fleetserve-hub"


def model_app_name(model_name: str) -> str:
    """The application of one model (its engine deployment's name); the chart writes the same."""
    return f"engine-{serve_safe(model_name)}"


def front_app_builder(args: dict[str, Any]) -> Application:
    """The ingress alone, reaching each model's application and the hub's by name.

    Args:
        args: ``{"platform": <platform config>}``.
    """
    config = parse_config(_platform_args(args), origin="serve application args")
    engines = {model.name: DeploymentRef(deployment_name(model), model_app_name(model.name))
               for model in config.models}
    return IngressDeployment.options(**ingress_options(config.limits, config.server)).bind(
        engines, DeploymentRef(HUB_DEPLOYMENT, HUB_APP), {model.name: model for model in config.models},
        config.model_routing, config.auth, config.limits, config, AppLayout.PER_MODEL_APPS, _batch_service(config))


def hub_app_builder(args: dict[str, Any]) -> Application:
    """The metrics hub alone. Its adapters come as its ``user_config`` (the chart writes the models'), which
    Serve hands to a running hub without a restart, keeping the adapters loaded at run time.

    Args:
        args: ``{"server": <the server settings it reads: custom_resources>}``.
    """
    server = ServerConfig.model_validate(args.get("server") or {})
    return MetricsHubDeployment.options(ray_actor_options=control_actor_options(server),
                                        user_config={"adapters": {}}).bind({})


def model_app_builder(args: dict[str, Any]) -> Application:
    """One model's engine deployment (its prefill and decode deployments, disaggregated), reaching the hub by name.
    Each replica resolves the model's source.

    Args:
        args: ``{"server": <the server settings engines read: serve_fast_path, drain_timeout_s>, "model": <one
            entry of the platform config's models>}``.
    """
    if "model" not in args:
        raise ConfigError("application args need a 'model' key holding one entry of the platform config's models")
    config = parse_config({"server": args.get("server") or {}, "models": [args["model"]]},
                          origin="serve application args")
    model = config.models[0]
    return _engine_deployment(model, cpu_bindings_per_deployment(config), None, DeploymentRef(HUB_DEPLOYMENT, HUB_APP),
                              Engine, config.server)


def _platform_args(args: dict[str, Any]) -> dict[str, Any]:
    if "platform" not in args:
        raise ConfigError("application args need a 'platform' key holding the fleetserve platform config")
    return args["platform"]


def app_builder(args: dict[str, Any]) -> Application:
    """Serve application builder for config files (RayService serveConfigV2, ``serve run``).

    Each replica resolves its own model source: the builder runs in a task on whichever node Serve picks (the
    head pod, without GPUs or room for weights), so a folder it fetched would not exist where replicas run.

    Args:
        args: ``{"platform": <platform config>}``, as the Helm chart writes it.
    """
    return build_app(parse_config(_platform_args(args), origin="serve application args"), resolve_locally=False)
