"""helm/fleetserve: renders, lints, validates against Kubernetes and CRD schemas, and says what values ask for."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "fleetserve"
CRDS = ROOT.parent / "shared" / "data" / "crds"
KUBERNETES_VERSION = "1.30.0"
MIG_GROUP = {"migProfile": "3g.40gb", "replicas": 1, "minReplicas": 0, "maxReplicas": 2, "cpu": "8", "memory": "64Gi"}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart renders for these values (empty templates dropped)."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name="demo", namespace="llm")
    return [doc for name, text in sorted(manifests.items()) if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def find(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    matches = [obj for obj in objects if obj["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, got {len(matches)}"
    return matches[0]


ALL_ON = {"workerGroups": {"colocated-3g-40gb": MIG_GROUP}, "apiKeys": {"keys": [{"sha256": "a" * 64, "tenant": "team-a"}]},
          "monitoring": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}}}


def test_chart_lints_clean():
    result = helm.lint(str(CHART))
    assert result["errors"] == []
    assert all(message["severity"] <= 1 for message in result["messages"]), result["messages"]  # info only


def test_every_values_key_has_a_doc_comment():
    # Leaf keys (with a value on their line) need a `# --` comment in the comment block just above;
    # the example platform config is documented by its own schema instead.
    lines = (CHART / "values.yaml").read_text().splitlines()
    section = None
    for index, line in enumerate(lines):
        if line and not line.startswith((" ", "#")):
            section = line.split(":")[0]
        key, _, value = line.strip().partition(":")
        if line.strip().startswith("#") or not _ or not value.strip() or section == "platform":
            continue
        above = index - 1
        while above >= 0 and lines[above].strip().startswith("#") and not lines[above].strip().startswith("# --"):
            above -= 1
        assert above >= 0 and lines[above].strip().startswith("# --"), f"values.yaml:{index + 1} `{key}` lacks `# --`"


@pytest.mark.parametrize("values", [{}, ALL_ON], ids=["defaults", "everything-on"])
def test_built_in_kinds_pass_kubernetes_validate_strict(values):
    objects = render(values)
    built_in = [obj for obj in objects if obj["apiVersion"] in ("v1", "policy/v1")]
    assert {obj["kind"] for obj in built_in} >= {"Service", "PodDisruptionBudget"}
    for obj in built_in:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _strict(schema: Any) -> Any:
    # kubectl's strict field validation: an object schema with properties and no preserve-unknown-fields
    # rejects unknown keys.
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


def crd_schema(file: str, version: str) -> dict[str, Any]:
    path = CRDS / file
    if not path.exists():
        pytest.skip(f"CRD schemas not found at {CRDS}")
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = _strict(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


@pytest.mark.parametrize("kind, file", [("RayService", "ray.io_rayservices.yaml"),
                                        ("ServiceMonitor", "monitoring.coreos.com_servicemonitors.yaml")])
def test_custom_resources_match_their_crds(kind, file):
    import jsonschema

    obj = find(render(ALL_ON), kind)
    jsonschema.validate(obj, crd_schema(file, obj["apiVersion"].split("/")[1]))


def test_crd_check_catches_a_misspelled_field():
    import jsonschema

    obj = find(render(ALL_ON), "RayService")
    obj["spec"]["rayClusterConfig"]["enableInTreeAutoscalling"] = True
    with pytest.raises(jsonschema.ValidationError, match="enableInTreeAutoscalling"):
        jsonschema.validate(obj, crd_schema("ray.io_rayservices.yaml", "v1"))


def test_mixed_strategy_requests_the_mig_resource_and_advertises_it_to_ray():
    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP}}), "RayService")
    [group] = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["groupName"] == "colocated-3g-40gb"
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 0, 2)
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == 1
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert group["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert json.loads(group["rayStartParams"]["resources"]) == {"mig-3g.40gb": 1}
    assert group["rayStartParams"]["num-gpus"] == "1"


def test_single_strategy_requests_a_gpu_on_nodes_labelled_with_the_profile():
    service = find(render({"gpu": {"migStrategy": "single", "product": "NVIDIA-H200"},
                           "workerGroups": {"decode-1g-18gb": {**MIG_GROUP, "migProfile": "1g.18gb"}}}), "RayService")
    [group] = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert group["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200-MIG-1g.18gb"


def test_a_whole_gpu_group_gives_each_pod_its_num_gpus_for_tensor_parallel_replicas():
    group = {**MIG_GROUP, "migProfile": "", "numGpus": 4}
    service = find(render({"gpu": {"migStrategy": "none", "product": "NVIDIA-H100-80GB-HBM3"},
                           "workerGroups": {"colocated-gpu": group}}), "RayService")
    [spec] = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert spec["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert spec["rayStartParams"]["num-gpus"] == "4"
    assert "resources" not in spec["rayStartParams"]
    jsonschema_validate_rayservice(service)


def jsonschema_validate_rayservice(service: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(service, crd_schema("ray.io_rayservices.yaml", "v1"))


def test_worker_groups_are_a_named_map_one_spec_each():
    groups = {"prefill-3g-40gb": MIG_GROUP, "decode-1g-10gb": {**MIG_GROUP, "migProfile": "1g.10gb", "maxReplicas": 6}}
    specs = find(render({"workerGroups": groups}), "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert sorted(spec["groupName"] for spec in specs) == sorted(groups)
    assert {s["groupName"]: s["maxReplicas"] for s in specs}["decode-1g-10gb"] == 6


def test_autoscaler_settings_reach_the_ray_cluster():
    cluster = find(render({"autoscaling": {"enableInTreeAutoscaling": False,
                                           "autoscalerOptions": {"upscalingMode": "Conservative",
                                                                 "idleTimeoutSeconds": 300}}}),
                   "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is False
    assert cluster["autoscalerOptions"] == {"upscalingMode": "Conservative", "idleTimeoutSeconds": 300}


def test_serve_config_parses_as_serve_applications_of_our_builders():
    from ray.serve.schema import ServeDeploySchema

    from fleetserve.deployments.builders import FRONT_APP, HUB_APP, model_app_name
    from fleetserve.deployments.metrics_hub import HUB_DEPLOYMENT
    from fleetserve.deployments.serve_options import deployment_options
    from fleetserve.platform.config import parse_config

    # A Hugging Face id as the name: the chart's schema takes what the platform config takes.
    llama = {"name": "meta-llama/Llama-3.1-8B", "source": "/models/llama", "replicas": 2,
             "autoscaling": {"min_replicas": 1, "max_replicas": 4},
             "resources": {"num_gpus": 1, "custom_resources": {"mig-3g.40gb": 1}},
             "lora": {"adapters": [{"name": "llama-sql", "source": "s3://adapters/sql"}]}}
    small = {"name": "small", "source": "/models/small", "lora": {}}
    platform = {"server": {"drain_timeout_s": 60, "num_ingress_replicas": 3}, "models": [llama, small]}
    service = find(render({"platform": platform}), "RayService")
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    apps = {app.name: app for app in serve_config.applications}
    assert list(apps) == [FRONT_APP, HUB_APP, model_app_name(llama["name"]), model_app_name("small")]
    for app in apps.values():
        module, attribute = app.import_path.split(":")
        assert callable(getattr(importlib.import_module(module), attribute))
    assert [app.route_prefix for app in apps.values()] == ["/", None, None, None]
    config = parse_config(apps[FRONT_APP].args["platform"])
    assert config.server.num_ingress_replicas == 3
    # Each model's application holds that model's entry and only the server settings engines read.
    model_app = apps[model_app_name(llama["name"])]
    assert model_app.args == {"server": {"drain_timeout_s": 60}, "model": llama}
    engine = parse_config({"server": model_app.args["server"], "models": [model_app.args["model"]]})
    options = deployment_options(engine.models[0], engine.server)
    assert (options["name"], options["autoscaling_config"]["max_replicas"]) == ("engine-meta-llama--Llama-3.1-8B", 4)
    assert options["ray_actor_options"]["resources"] == {"mig-3g.40gb": 1}
    assert options["graceful_shutdown_timeout_s"] == 60
    # The hub's registry: every base with lora, `lora: {}` included, as the builder's own would be.
    [hub] = apps[HUB_APP].deployments
    assert (hub.name, hub.user_config) == (HUB_DEPLOYMENT, {"adapters": {
        "meta-llama/Llama-3.1-8B": {"llama-sql": "s3://adapters/sql"}, "small": {}}})
    assert apps[HUB_APP].args == {"server": {}}


def test_a_change_to_one_model_changes_only_its_own_application():
    base = {"server": {"num_ingress_replicas": 2}, "models": [{"name": "a", "source": "/models/a"},
                                                               {"name": "b", "source": "/models/b"}]}
    changed = {**base, "models": [base["models"][0], {"name": "b", "source": "/models/b", "replicas": 3}]}
    ingress_only = {**base, "server": {"num_ingress_replicas": 4}}

    def apps(platform):
        serve_config = yaml.safe_load(find(render({"platform": platform}), "RayService")["spec"]["serveConfigV2"])
        return {app["name"]: app for app in serve_config["applications"]}

    before = apps(base)
    # Serve versions an application's deployments by its import path and args: equal args, kept replicas.
    assert [name for name, app in apps(changed).items() if app != before[name]] == ["fleetserve", "engine-b"]
    assert [name for name, app in apps(ingress_only).items() if app != before[name]] == ["fleetserve"]


def test_the_chart_runs_two_ingress_replicas_by_default():
    from fleetserve.deployments.serve_options import ingress_options
    from fleetserve.platform.config import parse_config

    # Also under a values file's own platform (as `fleetserve plan --emit-values` writes): Helm merges the maps.
    own = {"platform": {"models": [{"name": "llama", "source": "/models/llama", "resources": {"num_gpus": 1}}]}}
    for values in ({}, own):
        service = find(render(values), "RayService")
        platform = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["platform"]
        config = parse_config(platform)
        assert ingress_options(config.limits, config.server)["num_replicas"] == 2


def test_optional_objects_appear_only_when_enabled():
    assert {obj["kind"] for obj in render()} == {"RayService", "Service", "PodDisruptionBudget"}
    objects = render(ALL_ON)
    assert {obj["kind"] for obj in objects} == {"RayService", "Service", "PodDisruptionBudget", "ServiceMonitor",
                                                "ConfigMap", "Secret"}
    dashboard = find(objects, "ConfigMap")
    assert json.loads(dashboard["data"]["fleetserve.json"])["title"]
    # Hashes only, in the list format of platform.auth.api_keys_file.
    assert yaml.safe_load(find(objects, "Secret")["stringData"]["api-keys.yaml"]) == [
        {"sha256": "a" * 64, "tenant": "team-a"}]
    assert "PodDisruptionBudget" not in {o["kind"] for o in render({"podDisruptionBudget": {"enabled": False}})}


def test_every_pod_mounts_the_model_cache_and_points_every_cache_into_it():
    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP}}), "RayService")["spec"]
    cluster = service["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"],
            *(group["template"]["spec"] for group in cluster["workerGroupSpecs"])]
    for pod in pods:
        assert {"name": "model-cache", "hostPath": {"path": "/var/cache/fleetserve", "type": "DirectoryOrCreate"}} \
            in pod["volumes"]
        [container] = pod["containers"]
        assert {"name": "model-cache", "mountPath": "/var/cache/fleetserve"} in container["volumeMounts"]
        assert {"name": "FLEETSERVE_CACHE", "value": "/var/cache/fleetserve/models"} in container["env"]
        assert {"name": "VLLM_CACHE_ROOT", "value": "/var/cache/fleetserve/vllm"} in container["env"]
        assert {"name": "HF_HOME", "value": "/var/cache/fleetserve/huggingface"} in container["env"]
        assert "HF_TOKEN" not in {item["name"] for item in container["env"]}


def test_a_hub_token_secret_reaches_every_pod_as_hf_token():
    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP},
                           "hubToken": {"existingSecret": "hf", "key": "read-token"}}), "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]["template"]["spec"],
                *(group["template"]["spec"] for group in cluster["workerGroupSpecs"])]:
        [token] = [item for item in pod["containers"][0]["env"] if item["name"] == "HF_TOKEN"]
        assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "read-token"}}
    jsonschema_validate_rayservice(service)


def test_object_store_credentials_reach_every_pod_even_without_the_model_cache():
    # Before extraEnv, the env list rendered only with the model cache or the fast path on, so a hub token
    # alone left HF_TOKEN out of every pod.
    endpoint = {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"}
    keys = {"secretRef": {"name": "s3-keys"}}
    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP}, "modelCache": {"enabled": False},
                           "hubToken": {"existingSecret": "hf"}, "extraEnv": [endpoint], "extraEnvFrom": [keys],
                           "serviceAccountName": "model-reader"}), "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]["template"]["spec"],
                *(group["template"]["spec"] for group in cluster["workerGroupSpecs"])]:
        assert pod["serviceAccountName"] == "model-reader"
        [container] = pod["containers"]
        assert [item["name"] for item in container["env"]] == ["RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS", "HF_TOKEN",
                                                               "AWS_ENDPOINT_URL"]
        assert container["env"][2] == endpoint and container["envFrom"] == [keys]
    jsonschema_validate_rayservice(service)


def test_the_model_cache_takes_a_claim_or_can_be_left_out():
    head = find(render({"modelCache": {"existingClaim": "fleetserve-cache"}}),
                "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "fleetserve-cache"}} \
        in head["template"]["spec"]["volumes"]
    head = find(render({"modelCache": {"enabled": False}}), "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert [volume["name"] for volume in head["template"]["spec"]["volumes"]] == ["api-keys", "dshm"]
    # Serve's controller setting alone: no cache paths.
    assert head["template"]["spec"]["containers"][0]["env"] == [{"name": "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS",
                                                                 "value": "1"}]
    assert "envFrom" not in head["template"]["spec"]["containers"][0]
    assert "serviceAccountName" not in head["template"]["spec"]


@pytest.mark.parametrize(("server", "delay_s"), [
    ({}, 330),  # drain_timeout_s's default, 300 s, + 30 s for the Service switch to reach clients
    ({"drain_timeout_s": 42.5}, 73),  # ceil(42.5) + 30
])
def test_an_upgraded_away_cluster_is_kept_while_its_replicas_drain(server, delay_s):
    platform = {"server": server, "models": [{"name": "m", "source": "smollm2-135m-instruct"}]}
    service = find(render({"platform": platform}), "RayService")
    assert service["spec"]["rayClusterDeletionDelaySeconds"] == delay_s
    jsonschema_validate_rayservice(service)


def test_extra_volumes_mount_in_every_pod_beside_the_charts_own():
    claim = {"name": "routers", "persistentVolumeClaim": {"claimName": "fleetserve-routers"}}
    mount = {"name": "routers", "mountPath": "/models/routers", "readOnly": True}
    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP},
                           "extraVolumes": [claim], "extraVolumeMounts": [mount]}), "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]["template"]["spec"],
                *(group["template"]["spec"] for group in cluster["workerGroupSpecs"])]:
        assert [volume["name"] for volume in pod["volumes"]] == ["api-keys", "model-cache", "dshm", "routers"]
        assert pod["volumes"][-1] == claim
        assert pod["containers"][0]["volumeMounts"][-1] == mount
    jsonschema_validate_rayservice(service)


@pytest.mark.parametrize(("shared_memory", "volume"), [
    ({}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}),
    ({"sizeLimit": "16Gi"}, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}),
    ({"enabled": False}, None),
])
def test_every_pod_gets_a_memory_backed_dev_shm_unless_told_not_to(shared_memory, volume):
    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP}, "sharedMemory": shared_memory}),
                   "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]["template"]["spec"],
                *(group["template"]["spec"] for group in cluster["workerGroupSpecs"])]:
        volumes = {entry["name"]: entry for entry in pod["volumes"]}
        mounts = {entry["mountPath"]: entry["name"] for entry in pod["containers"][0]["volumeMounts"]}
        assert volumes.get("dshm") == volume
        assert mounts.get("/dev/shm") == (None if volume is None else "dshm")
    jsonschema_validate_rayservice(service)


def test_a_shared_memory_size_must_be_a_kubernetes_quantity():
    with pytest.raises(Exception, match="sizeLimit"):
        render({"sharedMemory": {"sizeLimit": "lots"}})


@pytest.mark.parametrize("server", [{}, {"serve_fast_path": True}, {"serve_fast_path": False}])
def test_every_pod_takes_serves_fast_path_as_the_platform_config_says(server):
    from fleetserve.deployments.serve_options import CONTROLLER_ENV, FAST_PATH_ENV

    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP},
                           "platform": {"server": server}}), "RayService")["spec"]
    cluster = service["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"],
            *(group["template"]["spec"] for group in cluster["workerGroupSpecs"])]
    # The proxies and the controller run outside the replicas' runtime_env: their pods carry the same options
    # (the job's runtime_env, fleetserve.deployments.serve_options.job_runtime_env).
    expected = {**CONTROLLER_ENV, **(FAST_PATH_ENV if server.get("serve_fast_path", False) else {})}
    for pod in pods:
        env = {item["name"]: item["value"] for item in pod["containers"][0]["env"]}
        assert {name: value for name, value in env.items() if name.startswith("RAY_SERVE_")} == expected


@pytest.mark.parametrize("values, message", [
    ({"gpu": {"migStrategy": "partial", "product": "x"}}, "value must be one of 'mixed', 'single', 'none'"),
    ({"workerGroups": {"Decode_Pool": MIG_GROUP}}, "does not match pattern"),
    ({"workerGroups": {"g": {**MIG_GROUP, "migProfile": "5g.10gb"}}}, "'5g.10gb' does not match pattern"),
    ({"workerGroups": {"g": {**MIG_GROUP, "replicas": -1}}}, "/workerGroups/g/replicas"),
    ({"workerGroups": {"g": {**MIG_GROUP, "numGpus": 9}}}, "/workerGroups/g/numGpus"),
    ({"replicaCount": 3}, "additional properties 'replicaCount' not allowed"),
    ({"platform": {"models": []}}, "/platform/models"),
    ({"platform": {"models": [{"name": "org//llama", "source": "x"}]}}, "/platform/models/0/name"),
    ({"platform": {"models": [{"name": "m", "source": "x", "replicas": -1}]}}, "/platform/models/0/replicas"),
    ({"modelCache": {"hostPath": "cache"}}, "/modelCache/hostPath"),
    ({"extraVolumeMounts": [{"name": "routers", "mountPath": "models"}]}, "/extraVolumeMounts/0/mountPath"),
])
def test_invalid_values_are_rejected_with_the_key_path(values, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        render(values)


def test_a_model_that_starts_at_zero_renders_with_no_initial_replica():
    zero = {"name": "m", "source": "x", "replicas": 0,
            "autoscaling": {"policy": "kv_cache", "min_replicas": 0, "max_replicas": 2}}
    service = find(render({"workerGroups": {"colocated-3g-40gb": MIG_GROUP}, "platform": {"models": [zero]}}),
                   "RayService")
    from fleetserve.platform.config import parse_config

    front, _, engine = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    # The platform config reaches the app builders as given; fleetserve's own validation takes replicas 0 with it.
    assert front["args"]["platform"]["models"] == [zero] and engine["args"]["model"] == zero
    assert parse_config(front["args"]["platform"]).models[0].replicas == 0


def test_a_mig_group_cannot_take_several_gpus_per_pod():
    with pytest.raises(Exception, match="numGpus above 1 needs whole GPUs"):
        render({"workerGroups": {"g": {**MIG_GROUP, "numGpus": 2}}})


def test_keda_example_matches_the_keda_crd():
    import jsonschema

    obj = yaml.safe_load((ROOT / "examples" / "keda" / "scaledobject.yaml").read_text())
    jsonschema.validate(obj, crd_schema("keda.sh_scaledobjects.yaml", "v1alpha1"))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) not installed")
def test_keda_example_queries_are_valid_promql(tmp_path):
    obj = yaml.safe_load((ROOT / "examples" / "keda" / "scaledobject.yaml").read_text())
    queries = [trigger["metadata"]["query"] for trigger in obj["spec"]["triggers"] if trigger["type"] == "prometheus"]
    rules = {"groups": [{"name": "keda", "rules": [{"record": f"keda:trigger_{index}", "expr": query}
                                                   for index, query in enumerate(queries)]}]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    done = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert done.returncode == 0 and f"SUCCESS: {len(queries)} rules found" in done.stdout, done.stdout + done.stderr
    # A misspelt function is caught, so the check above is not vacuous.
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "bad", "rules": [{"record": "bad", "expr": "derivv(up[1m])"}]}]}))
    assert subprocess.run(["promtool", "check", "rules", str(tmp_path / "bad.yaml")], capture_output=True).returncode != 0


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (Debian's prometheus; make test installs it)")


# fleetserve's PrometheusRule: its alerts load in Prometheus (promtool check rules) and fire on exactly the
# conditions they describe (promtool test rules, on hand-written series).
def rules(values: dict[str, Any] | None = None) -> dict[str, Any]:
    rule = {"enabled": True, "alertLabels": {"team": "llm"}, **(values or {})}
    return find(render({"monitoring": {"prometheusRule": rule}}), "PrometheusRule")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_alert_rules_load_in_prometheus(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules()["spec"]["groups"]}))
    done = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


def alert(name: str, labels: dict[str, str], summary: str, by_name: dict[str, Any]) -> dict[str, Any]:
    return {"exp_labels": {**labels, "severity": by_name[name]["labels"]["severity"], "team": "llm"},
            "exp_annotations": {"summary": summary, "description": by_name[name]["annotations"]["description"]}}


@needs_promtool
def test_each_alert_fires_on_its_condition_and_not_beside_it(tmp_path):
    rule = rules()
    by_name = {each["alert"]: each for each in rule["spec"]["groups"][0]["rules"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    requests = 'fleetserve_requests_total{{model="{model}", route="/v1/completions", status="{status}"}}'
    series = [
        # m: 90 ok and 10 failed per minute, 10% server errors; busy: half refused with 503, no server error.
        {"series": requests.format(model="m", status="200"), "values": "0+90x30"},
        {"series": requests.format(model="m", status="500"), "values": "0+10x30"},
        {"series": requests.format(model="busy", status="200"), "values": "0+50x30"},
        {"series": requests.format(model="busy", status="503"), "values": "0+50x30"},
        {"series": 'fleetserve_admission_rejections_total{model="busy", bound="queue"}', "values": "0+50x30"},
        # m's two replicas average 0.925 > 0.9; n's average 0.745 though one replica is at 0.99.
        {"series": 'vllm:kv_cache_usage_perc{model_name="m", pool="colocated", replica="r0"}', "values": "0.95x30"},
        {"series": 'vllm:kv_cache_usage_perc{model_name="m", pool="colocated", replica="r1"}', "values": "0.9x30"},
        {"series": 'vllm:kv_cache_usage_perc{model_name="n", pool="colocated", replica="r0"}', "values": "0.99x30"},
        {"series": 'vllm:kv_cache_usage_perc{model_name="n", pool="colocated", replica="r1"}', "values": "0.5x30"},
        # 6 preemptions a minute: 0.1 per second.
        {"series": 'vllm:num_preemptions_total{model_name="m", replica="r0"}', "values": "0+6x30"},
        # Every first token of m in (1, 2.5] s: p99 = 1 + 1.5 x 0.99 = 2.485 s; n's all within 1 s.
        {"series": 'vllm:time_to_first_token_seconds_bucket{model_name="m", le="1"}', "values": "0x30"},
        {"series": 'vllm:time_to_first_token_seconds_bucket{model_name="m", le="2.5"}', "values": "0+10x30"},
        {"series": 'vllm:time_to_first_token_seconds_bucket{model_name="m", le="+Inf"}', "values": "0+10x30"},
        {"series": 'vllm:time_to_first_token_seconds_bucket{model_name="n", le="1"}', "values": "0+10x30"},
        {"series": 'vllm:time_to_first_token_seconds_bucket{model_name="n", le="2.5"}', "values": "0+10x30"},
        {"series": 'vllm:time_to_first_token_seconds_bucket{model_name="n", le="+Inf"}', "values": "0+10x30"},
        # One retry of m at minute 3.
        {"series": 'fleetserve_engine_retries_total{model="m"}', "values": "0 0 0 1x27"},
        # m's requests held for good; n's held once, then released.
        {"series": 'fleetserve_held_requests{model="m"}', "values": "3x30"},
        {"series": 'fleetserve_held_requests{model="n"}', "values": "3 3 0x28"},
    ]
    expected = {
        "FleetserveServerErrors": [alert("FleetserveServerErrors", {"model": "m"},
                                         "m: 10% of responses are server errors", by_name)],
        "FleetserveRefusingRequests": [alert("FleetserveRefusingRequests", {"model": "busy"},
                                             "busy: 50% of requests refused at admission (503)", by_name)],
        "FleetserveKVCacheFull": [alert("FleetserveKVCacheFull", {"model_name": "m", "pool": "colocated"},
                                        "m (colocated pool): KV cache 92.5% used", by_name)],
        "FleetservePreempting": [alert("FleetservePreempting", {"model_name": "m"},
                                       "m: engines preempt 0.1 requests/s", by_name)],
        "FleetserveSlowFirstToken": [alert("FleetserveSlowFirstToken", {"model_name": "m"},
                                           "m: p99 time to first token 2.485s", by_name)],
        "FleetserveReplicaFailures": [alert("FleetserveReplicaFailures", {"model": "m"}, "m: requests re-sent in the "
                                            "last 10 minutes after their replica failed", by_name)],
        "FleetserveColdStartStuck": [alert("FleetserveColdStartStuck", {"model": "m"},
                                           "m: requests held for 10 minutes waiting for a replica to start", by_name)],
    }
    retried = expected.pop("FleetserveReplicaFailures")
    # At 20 minutes every other condition has held longer than its `for`; at 4 minutes none has yet.
    cases = [{"eval_time": "20m", "alertname": name, "exp_alerts": alerts} for name, alerts in expected.items()]
    cases += [{"eval_time": "4m", "alertname": name, "exp_alerts": []} for name in expected]
    # The retry (no `for`) alerts while it lies within the 10-minute window: at 4 and 12 minutes (windows from
    # minute 2), not at 14 (the window from minute 4 holds no increase).
    cases += [{"eval_time": at, "alertname": "FleetserveReplicaFailures", "exp_alerts": alerts}
              for at, alerts in (("2m", []), ("4m", retried), ("12m", retried), ("14m", []))]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}]}))
    done = promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_thresholds_come_from_values():
    rule = rules({"serverErrorRatio": 0.2, "kvCacheUsage": 0.75, "ttftP99Seconds": 0.5, "refusedRatio": 0.1})
    exprs = {each["alert"]: each["expr"] for each in rule["spec"]["groups"][0]["rules"]}
    assert exprs["FleetserveServerErrors"].endswith("> 0.2")
    assert exprs["FleetserveRefusingRequests"].endswith("> 0.1")
    assert exprs["FleetserveKVCacheFull"].endswith("> 0.75")
    assert exprs["FleetserveSlowFirstToken"].endswith("> 0.5")


def test_every_alert_metric_is_one_fleetserve_documents():
    import re

    documented = set(re.findall(r"^\| `([a-z_:]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    exprs = [each["expr"] for each in rules()["spec"]["groups"][0]["rules"]]
    used = {re.sub(r"_bucket$", "", name) for expr in exprs
            for name in re.findall(r"\b(vllm:[a-z0-9_]+|fleetserve_[a-z0-9_]+)", expr)}
    # A misspelt metric would leave its alert silent for good.
    assert len(used) == 7 and used <= documented, used - documented
