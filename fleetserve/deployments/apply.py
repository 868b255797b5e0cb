"""Changes a running platform in place (``fleetserve apply``): Serve redeploys the application, keeping the
replicas of every deployment whose version is unchanged and rolling the others."""

from __future__ import annotations

import time

from ray import serve

from fleetserve.deployments.app_layout import AppLayout
from fleetserve.deployments.builders import build_app
from fleetserve.deployments.local_run import APP_NAME, run_application
from fleetserve.deployments.metrics_hub import HUB_DEPLOYMENT
from fleetserve.platform.config import ConfigError, PlatformConfig
from fleetserve.platform.config.diff import ConfigChange, diff_configs
from fleetserve.platform.lora_store import AdapterSourceError, check_adapter_source


def running_config(app_name: str = APP_NAME) -> PlatformConfig:
    """The platform config the running application was built from.

    Raises:
        ConfigError: no fleetserve application of that name runs on this Ray cluster.
    """
    if app_name not in serve.status().applications:
        raise ConfigError(f"no Serve application {app_name!r} runs on this Ray cluster; start one with "
                          f"`fleetserve serve` first")
    config = serve.get_app_handle(app_name).running_config.remote().result()
    if config is None:
        raise ConfigError(f"application {app_name!r} was not built by fleetserve's builder")
    return config


def listening_as_running(config: PlatformConfig, running: PlatformConfig) -> PlatformConfig:
    """``config``, listening where the running platform does unless it names its own host or port: a platform
    started with ``serve --port`` keeps that port through an apply of the file it was started from."""
    server = config.server
    return config.listening_at(*(None if key in server.model_fields_set else getattr(running.server, key)
                                 for key in ("host", "port")))


def running_layout(app_name: str = APP_NAME) -> AppLayout:
    """How the running platform's applications were built (``running_config`` checks that it runs)."""
    return serve.get_app_handle(app_name).layout.remote().result()


# How long apply waits for every replica of a base model to serve its changed adapters.
ADAPTER_SYNC_TIMEOUT_S = 60.0
ADAPTER_POLL_S = 0.5


class AdapterSyncError(Exception):
    """Replicas that did not serve a model's new adapters in time (an adapter that fails to load, as a rule)."""


# Server keys a running platform takes: cors, read by the ingress's replicas alone (applied by rolling them), and
# drain_timeout_s, a Serve option that Serve reconfigures on running replicas.
SERVER_KEYS_APPLIED = frozenset({"cors", "drain_timeout_s"})


def plan_change(config: PlatformConfig, app_name: str = APP_NAME) -> ConfigChange:
    """What applying ``config`` would change.

    Raises:
        ConfigError: no such application, a change apply cannot make (the listening address), or an adapter
            source that cannot load.
    """
    return _plan(config, app_name)[0]


def _plan(config: PlatformConfig, app_name: str) -> tuple[ConfigChange, PlatformConfig, AppLayout]:
    """The change, ``config`` listening where the running platform does, and how the platform was built (each read
    from the running application once)."""
    running = running_config(app_name)
    config = listening_as_running(config, running)
    layout = running_layout(app_name)
    if layout is AppLayout.PER_MODEL_APPS:
        raise ConfigError(f"application {app_name!r} is the front door of the chart's applications (a RayService): "
                          f"change the platform with `helm upgrade`, which rewrites each model's application")
    change = diff_configs(running, config)
    _check_changed_adapters(config, change)
    if "server" in change.sections:
        before, after = running.server.model_dump(), config.server.model_dump()
        fixed = sorted(key for key in after if after[key] != before[key] and key not in SERVER_KEYS_APPLIED)
        if fixed:
            raise ConfigError(f"server: {', '.join(fixed)} cannot change while the platform runs (where it listens "
                              f"and how Serve runs the ingress); restart `fleetserve serve` to change them")
    return change, config, layout


def _check_changed_adapters(config: PlatformConfig, change: ConfigChange) -> None:
    """Refuses adapter sources that cannot load before any replica tries (where they would fail one by one, in
    logs, while apply waited for them)."""
    for name in [*change.added, *change.changed]:
        lora = config.model(name).lora
        for adapter in lora.adapters if lora is not None else []:
            try:
                check_adapter_source(adapter.source, lora.max_lora_rank)
            except AdapterSourceError as error:
                raise ConfigError(f"models[{name}].lora.adapters[{adapter.name}]: {error}") from None


def apply_config(config: PlatformConfig, app_name: str = APP_NAME, route_prefix: str = "/") -> ConfigChange:
    """Applies ``config`` to the running application; returns once every deployment runs it.

    Admitted requests finish: models that stay keep their replicas (or roll them, new before old), and a
    stopped deployment's replicas get ``server.drain_timeout_s`` to finish theirs.

    Raises:
        ConfigError: as ``plan_change``.
        AppStartError: a deployment failed to start, with its replicas' own error.
        AdapterSyncError: replicas that did not serve a model's changed adapters within
            ``ADAPTER_SYNC_TIMEOUT_S``.
    """
    change, config, layout = _plan(config, app_name)
    # Built as the running platform was: a model whose config is unchanged keeps its version, and its replicas.
    run_application(build_app(config, resolve_locally=layout is AppLayout.DRIVER_SOURCES), app_name, route_prefix)
    wait_for_adapters([name for name, keys in change.changed.items() if "lora.adapters" in keys], app_name)
    return change


def wait_for_adapters(models: list[str], app_name: str = APP_NAME,
                      timeout_s: float = ADAPTER_SYNC_TIMEOUT_S) -> None:
    """Waits until every live replica of each model serves the hub's current adapter set.

    Raises:
        AdapterSyncError: some replicas had not caught up after ``timeout_s``, naming each model's count.
    """
    if not models:
        return
    hub = serve.get_deployment_handle(HUB_DEPLOYMENT, app_name)
    versions = {model: hub.adapter_set.remote(model).result().version for model in models}
    deadline = time.monotonic() + timeout_s
    while True:
        progress = {model: hub.adapter_progress.remote(model, version).result() for model, version in versions.items()}
        behind = {model: (done, live) for model, (done, live) in progress.items() if done < live}
        if not behind:
            return
        if time.monotonic() > deadline:
            counts = ", ".join(f"{model}: {done} of {live} replicas" for model, (done, live) in behind.items())
            raise AdapterSyncError(f"the new adapters are not served after {timeout_s:.0f} s ({counts}); an adapter "
                                   f"that fails to load is named in its replicas' logs")
        time.sleep(ADAPTER_POLL_S)
