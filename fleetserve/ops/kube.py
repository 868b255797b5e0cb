"""Deploy to Kubernetes: render the chart's RayService and create or patch it; read its status.

Rendering uses helm-python-sdk (Helm's Go SDK, no helm binary); the API calls use the official
``kubernetes`` client against whatever cluster the kubeconfig names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetserve.platform.config import RAY_MIG_RESOURCE_PREFIX, parse_config
from fleetserve.platform.config.paths import ConfigPath, config_paths, outside

CHART = Path(__file__).resolve().parents[2] / "helm" / "fleetserve"
GROUP, VERSION, PLURAL = "ray.io", "v1", "rayservices"


class DeployError(RuntimeError):
    """Rendering or applying failed; the message says what to fix."""


def merge_values(*layers: dict[str, Any]) -> dict[str, Any]:
    """Merges values the way ``helm -f a -f b`` does: maps deeply, everything else replaced."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = merge_values(merged[key], value)
            else:
                merged[key] = value
    return merged


def _mig_slices(model: dict[str, Any]) -> list[str]:
    """The MIG profiles a model's replicas ask Ray for (``mig-<profile>`` custom resources); a disaggregated
    model's pools each take the model's custom resources unless they name their own."""
    own = (model.get("resources") or {}).get("custom_resources") or {}
    pools = model.get("disaggregation")
    asked = [own] if pools is None else [
        own if (pools.get(pool) or {}).get("custom_resources") is None else pools[pool]["custom_resources"]
        for pool in ("prefill", "decode")]
    return sorted({key.removeprefix(RAY_MIG_RESOURCE_PREFIX) for each in asked for key in each
                   if key.startswith(RAY_MIG_RESOURCE_PREFIX)})


def check_placement(values: dict[str, Any]) -> None:
    """Refuses values whose models no pod could hold: a model pinned to a MIG slice (``resources.
    custom_resources: {mig-<profile>: 1}``) with no worker group of that ``migProfile``, one asking for a
    GPU with no worker group at all (the head pod offers no GPU to Ray), or one asking for more GPUs per
    replica (tensor parallelism) than any group's pods hold. KubeRay's autoscaler would never
    find a node for them, and Serve would wait for their replicas forever.

    Raises:
        DeployError: naming each such model and what it asks for.
    """
    groups = values.get("workerGroups") or {}
    profiles = {group.get("migProfile") for group in groups.values() if group.get("migProfile")}
    # The most whole GPUs one pod of any group offers Ray (a tensor-parallel replica needs them on one pod).
    most_gpus = max((group.get("numGpus") or 1 for group in groups.values() if not group.get("migProfile")), default=0)
    problems = []
    for model in (values.get("platform") or {}).get("models") or []:
        resources = model.get("resources") or {}
        num_gpus = resources.get("num_gpus") or 0
        missing = [profile for profile in _mig_slices(model) if profile not in profiles]
        if missing:
            problems.append(f"model {model.get('name')} asks for a {', '.join(missing)} MIG slice, which no worker "
                            f"group offers (migProfile: {', '.join(sorted(profiles)) or 'none'})")
        elif num_gpus > 0 and not groups:
            problems.append(f"model {model.get('name')} asks for a GPU, and the values define no worker group")
        elif num_gpus > 1 and num_gpus > most_gpus:
            problems.append(f"model {model.get('name')} asks for {num_gpus:g} GPUs per replica, and no worker group's "
                            f"pods hold more than {most_gpus} whole GPUs (numGpus)")
    if problems:
        raise DeployError("; ".join(problems) + ". `fleetserve plan CONFIG --emit-values` writes worker groups "
                          "for a config's models")


def render_rayservice(values: dict[str, Any], name: str, namespace: str, chart: Path = CHART) -> dict[str, Any]:
    """The RayService object the chart renders for these values.

    Raises:
        DeployError: no chart at ``chart``, or values the chart's schema rejects.
    """
    import helm_python as helm

    if not (chart / "Chart.yaml").exists():
        raise DeployError(f"no Helm chart at {chart}; pass --chart helm/fleetserve from a fleetserve checkout")
    try:
        with helm.Chart.load(str(chart)) as loaded:
            manifests = loaded.render(values, name=name, namespace=namespace)
    except helm.HelmError as error:
        raise DeployError(f"the chart rejected these values: {error}") from None
    for template, text in manifests.items():
        if not template.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "RayService":
                doc["metadata"]["namespace"] = namespace
                return doc
    raise DeployError("the chart rendered no RayService")


def unmounted_paths(obj: dict[str, Any]) -> list[ConfigPath]:
    """The paths a rendered RayService's platform config names that lie under none of its head pod's volume
    mounts (every pod mounts the same volumes): unless the image holds them, its replicas will not find them."""
    serve_config = yaml.safe_load(obj["spec"]["serveConfigV2"])
    platform = parse_config(serve_config["applications"][0]["args"]["platform"], origin="the values' platform")
    [container] = obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    return outside(config_paths(platform), [mount["mountPath"] for mount in container.get("volumeMounts") or []])


def _api(kubeconfig: str | None, context: str | None) -> Any:
    from kubernetes import client, config

    try:
        api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
    except config.ConfigException as error:
        raise DeployError(f"cannot load kubeconfig: {error}") from None
    return client.CustomObjectsApi(api_client)


def apply_rayservice(obj: dict[str, Any], kubeconfig: str | None = None, context: str | None = None) -> str:
    """Creates the RayService, or merge-patches its spec when it exists; returns "created" or "patched".

    Raises:
        DeployError: with the API server's reason.
    """
    from kubernetes.client.exceptions import ApiException

    api = _api(kubeconfig, context)
    name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
    try:
        api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as error:
        if error.status != 404:
            raise DeployError(f"reading RayService {namespace}/{name}: {error.status} {error.reason}") from None
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, obj)
        except ApiException as create_error:
            raise DeployError(f"creating RayService {namespace}/{name}: {create_error.status} "
                              f"{create_error.reason}: {create_error.body}") from None
        return "created"
    try:
        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                           {"metadata": {"labels": obj["metadata"].get("labels", {})},
                                            "spec": obj["spec"]})
    except ApiException as error:
        raise DeployError(f"patching RayService {namespace}/{name}: {error.status} {error.reason}") from None
    return "patched"


@dataclass
class RayServiceStatus:
    """What KubeRay reports about a RayService, flattened for a table."""

    name: str
    namespace: str
    # Running, or empty while the first cluster comes up.
    service_status: str
    ready: bool
    upgrading: bool
    active_cluster: str | None
    pending_cluster: str | None
    # application -> status, and "application/deployment" -> status.
    applications: dict[str, str] = field(default_factory=dict)
    deployments: dict[str, str] = field(default_factory=dict)


def rayservice_status(name: str, namespace: str, kubeconfig: str | None = None,
                      context: str | None = None) -> RayServiceStatus:
    """Reads a RayService's status.

    Raises:
        DeployError: not found, or the API server refused.
    """
    from kubernetes.client.exceptions import ApiException

    try:
        obj = _api(kubeconfig, context).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as error:
        if error.status == 404:
            raise DeployError(f"RayService {namespace}/{name} not found; deploy it with `fleetserve deploy`") from None
        raise DeployError(f"reading RayService {namespace}/{name}: {error.status} {error.reason}") from None
    status = obj.get("status") or {}
    conditions = {c.get("type"): c.get("status") == "True" for c in status.get("conditions", [])}
    active = status.get("activeServiceStatus") or {}
    pending = status.get("pendingServiceStatus") or {}
    result = RayServiceStatus(name, namespace, status.get("serviceStatus", ""), conditions.get("Ready", False),
                              conditions.get("UpgradeInProgress", False), active.get("rayClusterName"),
                              pending.get("rayClusterName"))
    for app_name, app in (active.get("applicationStatuses") or {}).items():
        result.applications[app_name] = app.get("status", "")
        for deployment, state in (app.get("serveDeploymentStatuses") or app.get("deployments") or {}).items():
            result.deployments[f"{app_name}/{deployment}"] = state.get("status", "")
    return result
