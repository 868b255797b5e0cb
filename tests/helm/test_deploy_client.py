"""`fleetserve deploy` and `fleetserve status --k8s` through the real kubernetes client.

No Kubernetes API server is available here, so a small one on loopback implements the endpoints
these commands use (get, create and merge-patch of ray.io/v1 RayServices) with the API server's
status codes and Status bodies. What it cannot show: admission webhooks, RBAC, and KubeRay acting on
the object; the test plays KubeRay by writing a status.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.loadtest.local_server import free_port

pytest.importorskip("kubernetes")
pytest.importorskip("helm_python")
PREFIX = "/apis/ray.io/v1/namespaces/{namespace}/rayservices"


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def status_body(code: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                         "reason": reason, "code": code}, status_code=code)


def api_server(store: dict, calls: list) -> FastAPI:
    api = FastAPI()

    @api.get(PREFIX + "/{name}")
    async def get(namespace: str, name: str):
        calls.append(("GET", namespace, name))
        if (namespace, name) not in store:
            return status_body(404, "NotFound", f'rayservices.ray.io "{name}" not found')
        return store[(namespace, name)]

    @api.post(PREFIX)
    async def create(namespace: str, request: Request):
        obj = await request.json()
        name = obj["metadata"]["name"]
        calls.append(("POST", namespace, name))
        if (namespace, name) in store:
            return status_body(409, "AlreadyExists", f'rayservices.ray.io "{name}" already exists')
        obj["metadata"].update({"namespace": namespace, "uid": "uid-1", "resourceVersion": "1", "generation": 1})
        store[(namespace, name)] = obj
        return JSONResponse(obj, status_code=201)

    @api.patch(PREFIX + "/{name}")
    async def patch(namespace: str, name: str, request: Request):
        calls.append(("PATCH", namespace, name, request.headers["content-type"]))
        if request.headers["content-type"] != "application/merge-patch+json":
            return status_body(415, "UnsupportedMediaType", "expected a merge patch")
        obj = merge_patch(store[(namespace, name)], await request.json())
        obj["metadata"]["generation"] += 1
        store[(namespace, name)] = obj
        return obj

    return api


@pytest.fixture
def cluster(tmp_path):
    store, calls = {}, []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api_server(store, calls), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "loopback", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "loopback", "user": "tester"}}]}))
    yield store, calls, str(kubeconfig)
    server.should_exit = True
    thread.join(timeout=5)


def values_file(tmp_path, max_replicas: int):
    path = tmp_path / f"values-{max_replicas}.yaml"
    path.write_text(yaml.safe_dump({"workerGroups": {"colocated-1g-10gb": {
        "migProfile": "1g.10gb", "replicas": 1, "minReplicas": 0, "maxReplicas": max_replicas, "cpu": "4",
        "memory": "32Gi"}}}))
    return str(path)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_deploy_creates_then_patches_the_rayservice(cluster, tmp_path):
    store, calls, kubeconfig = cluster
    common = ["--name", "demo", "--namespace", "llm", "--kubeconfig", kubeconfig]
    result = run("deploy", "-f", values_file(tmp_path, 2), *common)
    assert result.exit_code == 0, result.output
    assert "created" in result.output
    obj = store[("llm", "demo")]
    assert obj["kind"] == "RayService"
    assert obj["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] == 2
    assert "fleetserve.deployments.builders:front_app_builder" in obj["spec"]["serveConfigV2"]

    result = run("deploy", "-f", values_file(tmp_path, 5), *common)
    assert result.exit_code == 0, result.output
    assert "patched" in result.output
    assert store[("llm", "demo")]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] == 5
    assert store[("llm", "demo")]["metadata"]["uid"] == "uid-1"  # patched in place, not recreated
    assert [call[0] for call in calls] == ["GET", "POST", "GET", "PATCH"]


def test_status_reads_what_kuberay_reports(cluster, tmp_path):
    store, _, kubeconfig = cluster
    common = ["--name", "demo", "--namespace", "llm", "--kubeconfig", kubeconfig]
    result = run("status", "--k8s", *common)
    assert result.exit_code == 1 and "RayService llm/demo not found" in " ".join(result.output.split())
    assert run("deploy", "-f", values_file(tmp_path, 2), *common).exit_code == 0
    obj = copy.deepcopy(store[("llm", "demo")])
    obj["status"] = {  # as KubeRay writes it once Serve is up
        "serviceStatus": "Running",
        "conditions": [{"type": "Ready", "status": "True"}, {"type": "UpgradeInProgress", "status": "False"}],
        "activeServiceStatus": {"rayClusterName": "demo-raycluster-x7k2p", "applicationStatuses": {"fleetserve": {
            "status": "RUNNING", "serveDeploymentStatuses": {"ingress": {"status": "HEALTHY"},
                                                             "engine-smollm2-135m-instruct": {"status": "UPDATING"}}}}}}
    store[("llm", "demo")] = obj
    result = run("status", "--k8s", *common)
    assert result.exit_code == 0, result.output
    for text in ("Running", "demo-raycluster-x7k2p", "application fleetserve", "RUNNING",
                 "fleetserve/engine-smollm2-135m-instruct", "UPDATING"):
        assert text in result.output


def test_deploy_reports_values_the_chart_rejects_without_calling_the_api(cluster, tmp_path):
    _, calls, kubeconfig = cluster
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"gpu": {"migStrategy": "sometimes", "product": "x"}}))
    result = run("deploy", "-f", str(bad), "--kubeconfig", kubeconfig)
    assert result.exit_code == 1
    assert "value must be one of 'mixed', 'single', 'none'" in result.output
    assert calls == []


@pytest.mark.parametrize(("resources", "groups", "message"), [
    ({"num_gpus": 1, "custom_resources": {"mig-3g.40gb": 1}}, {"colocated-1g-10gb": {"migProfile": "1g.10gb"}},
     "model m asks for a 3g.40gb MIG slice, which no worker group offers (migProfile: 1g.10gb)"),
    ({"num_gpus": 1}, {}, "model m asks for a GPU, and the values define no worker group"),
    # A tensor-parallel replica's GPUs must be on one pod.
    ({"num_gpus": 4}, {"colocated-2gpu": {"migProfile": "", "numGpus": 2}},
     "model m asks for 4 GPUs per replica, and no worker group's pods hold more than 2 whole GPUs (numGpus)"),
    # A disaggregated pool's own slice counts too.
    ({"num_gpus": 1, "custom_resources": {"mig-1g.10gb": 1}, "_decode": {"mig-2g.20gb": 1}},
     {"colocated-1g-10gb": {"migProfile": "1g.10gb"}},
     "model m asks for a 2g.20gb MIG slice, which no worker group offers (migProfile: 1g.10gb)"),
])
def test_deploy_refuses_models_no_worker_group_can_hold(cluster, tmp_path, resources, groups, message):
    _, calls, kubeconfig = cluster
    values = tmp_path / "values.yaml"
    decode = resources.pop("_decode", None)
    pools = {"disaggregation": {"decode": {"custom_resources": decode}}} if decode else {}
    values.write_text(yaml.safe_dump({
        "platform": {"models": [{"name": "m", "source": "tiny-random-llama", "resources": resources, **pools}]},
        "workerGroups": {name: {**group, "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "cpu": "4",
                                "memory": "32Gi"} for name, group in groups.items()}}))
    result = run("deploy", "-f", str(values), "--kubeconfig", kubeconfig)
    assert result.exit_code == 1 and message in " ".join(result.output.split())
    assert "fleetserve plan CONFIG --emit-values" in " ".join(result.output.split())
    assert calls == []


def test_deploy_accepts_a_model_on_a_slice_its_values_offer(cluster, tmp_path):
    _, _, kubeconfig = cluster
    values = tmp_path / "values.yaml"
    # Both pools name their own slice, so the model's own (offered by no group) is asked for by no replica.
    pools = {pool: {"custom_resources": {"mig-1g.10gb": 1}} for pool in ("prefill", "decode")}
    values.write_text(yaml.safe_dump({
        "platform": {"models": [{"name": "m", "source": "tiny-random-llama", "disaggregation": pools,
                                 "resources": {"num_gpus": 1, "custom_resources": {"mig-7g.80gb": 1}}}]},
        "workerGroups": {"colocated-1g-10gb": {"migProfile": "1g.10gb", "replicas": 1, "minReplicas": 0,
                                               "maxReplicas": 1, "cpu": "4", "memory": "32Gi"}}}))
    result = run("deploy", "-f", str(values), "--kubeconfig", kubeconfig, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "kind: RayService" in result.output


def routed_config(tmp_path, checkpoint: str):
    path = tmp_path / "routed.yaml"
    path.write_text(yaml.safe_dump({
        "models": [{"name": "tiny", "source": "tiny-random-llama"}, {"name": "big", "source": "tiny-random-llama"}],
        "model_routing": {"checkpoints": {"mlp": checkpoint}, "tiers": ["tiny", "big"],
                          "routes": [{"name": "auto", "router": "mlp", "strong_fraction": 0.3}]}}))
    return str(path)


def test_deploy_warns_about_config_paths_no_pod_volume_holds_and_still_deploys(cluster, tmp_path):
    store, _, kubeconfig = cluster
    # A checkpoint relative to the config becomes this machine's path, which the pods do not have.
    result = run("deploy", "-f", values_file(tmp_path, 2), "--config", routed_config(tmp_path, "routers/mlp"),
                 "--name", "demo", "--namespace", "llm", "--kubeconfig", kubeconfig)
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert f"model_routing.checkpoints.mlp: {tmp_path / 'routers' / 'mlp'}." in output
    assert "extraVolumes and extraVolumeMounts" in output
    assert ("llm", "demo") in store


def test_deploy_is_quiet_about_config_paths_a_mounted_volume_holds(cluster, tmp_path):
    _, _, kubeconfig = cluster
    values = tmp_path / "mounts.yaml"
    values.write_text(yaml.safe_dump({
        "extraVolumes": [{"name": "routers", "persistentVolumeClaim": {"claimName": "routers"}}],
        "extraVolumeMounts": [{"name": "routers", "mountPath": "/models/routers"}]}))
    result = run("deploy", "-f", values_file(tmp_path, 2), "-f", str(values),
                 "--config", routed_config(tmp_path, "/models/routers/mlp"), "--kubeconfig", kubeconfig, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    assert "mountPath: /models/routers" in result.output
