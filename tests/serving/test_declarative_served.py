"""The chart's serveConfigV2 deployed through Serve's declarative API (as KubeRay deploys it), on a Ray cluster of
its own: each model is an application of its own, so a change to one model restarts that model's replicas alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from factories import model_entry
from fleetserve.loadtest.local_server import free_port

pytestmark = pytest.mark.slow
helm = pytest.importorskip("helm", reason="the chart renders through helm-python-sdk (the dev extra)")

SCRIPT = Path(__file__).with_name("declarative_apps.py")


def serve_config(tmp_path: Path, name: str, models: list[dict]) -> Path:
    sys.path.insert(0, str(Path(__file__).parents[1] / "helm"))
    from test_chart import find, render

    platform = {"server": {"num_ingress_replicas": 1}, "models": models}
    path = tmp_path / f"{name}.yaml"
    path.write_text(find(render({"platform": platform}), "RayService")["spec"]["serveConfigV2"])
    return path


def tiny(name: str, **engine_args) -> dict:
    return {**model_entry(name, **engine_args), "resources": {"num_cpus": 0.1}}


def test_a_change_to_one_model_restarts_only_that_models_replicas(tmp_path):
    from local_cluster import clean_env

    before = serve_config(tmp_path, "before", [tiny("a"), tiny("b")])
    after = serve_config(tmp_path, "after", [tiny("a"), tiny("b", max_num_seqs=8)])
    done = subprocess.run([sys.executable, str(SCRIPT), str(free_port()), str(before), str(after)],
                          capture_output=True, text=True, timeout=900, env=clean_env())
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    first, second = json.loads(lines[0][len("RESULT "):])
    for step in (first, second):
        # Requests cross from the front door's application to each model's, and the hub (its own application)
        # collects both engines' metrics.
        assert step["statuses"] == {"a": 200, "b": 200}
        assert step["metrics_models"] == ["a", "b"]
        # apply would deploy one application over the chart's (a second engine per model): refused.
        assert step["apply"].startswith("application 'fleetserve' is the front door of the chart's applications")
    assert second["replicas"]["engine-a"] == first["replicas"]["engine-a"]  # kept
    assert second["replicas"]["engine-b"] != first["replicas"]["engine-b"]  # restarted with its new args
    assert yaml.safe_load(after.read_text())["applications"][3]["args"]["model"]["engine_args"]["max_num_seqs"] == 8
