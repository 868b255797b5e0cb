"""Deploys serveConfigV2 documents (the chart's) one after the other on a Ray cluster of its own, through Serve's
declarative API as KubeRay does, and prints what happened as one ``RESULT <json>`` line.

Usage: python declarative_apps.py PORT CONFIG.yaml [CONFIG.yaml ...]

After each deployment (once every application runs): each engine application's replica actor ids, and the
status of a greedy completion for each model through the front door on PORT, and what `fleetserve apply` says.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import ray
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

DEPLOY_TIMEOUT_S = 300.0


def replica_ids(app: str) -> list[str]:
    """The live replica actors of the deployment named like its application (a model's engine deployment), by
    name: ``SERVE_REPLICA::<app>#<deployment>#<replica id>``, the id new for each replica Serve starts."""
    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["name"].startswith(f"SERVE_REPLICA::{app}#{app}#"))


def wait_running(config: ServeDeploySchema, previous: dict[str, list[str]]) -> None:
    """Until every application runs and each engine application has one live replica (a replaced one gone)."""
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    names = [app.name for app in config.applications]
    while time.monotonic() < deadline:
        status = serve.status().applications
        running = all(name in status and status[name].status == "RUNNING" for name in names)
        engines = [name for name in names if name.startswith("engine-")]
        if running and all(len(replica_ids(name)) == 1 for name in engines):
            return
        time.sleep(1)
    raise RuntimeError(f"not running after {DEPLOY_TIMEOUT_S:g} s: {serve.status().applications}")


def apply_refusal(config: ServeDeploySchema) -> str:
    """What `fleetserve apply` says to the front door's platform config, applied unchanged."""
    from fleetserve.deployments.apply import plan_change
    from fleetserve.platform.config import ConfigError, parse_config

    front = next(app for app in config.applications if app.name == "fleetserve")
    try:
        plan_change(parse_config(front.args["platform"]))
    except ConfigError as error:
        return str(error)
    return "not refused"


def main() -> None:
    port, paths = int(sys.argv[1]), sys.argv[2:]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    client = serve.context._get_global_client()
    steps, previous = [], {}
    for path in paths:
        config = ServeDeploySchema.model_validate(yaml.safe_load(open(path).read()))
        client.deploy_apps(config)
        wait_running(config, previous)
        engines = [app.name for app in config.applications if app.name.startswith("engine-")]
        previous = {name: replica_ids(name) for name in engines}
        statuses = {}
        for app in config.applications:
            if app.name.startswith("engine-"):
                model = app.args["model"]["name"]
                response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
                    "model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
                statuses[model] = response.status_code
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        served = sorted({line.split('model_name="')[1].split('"')[0] for line in metrics.splitlines()
                         if line.startswith("vllm:num_requests_running{") and 'model_name="' in line})
        steps.append({"replicas": previous, "statuses": statuses, "metrics_models": served,
                      "apply": apply_refusal(config)})
    print("RESULT " + json.dumps(steps), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
