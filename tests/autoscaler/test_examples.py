"""The example policy files load and run in the simulator as docs/autoscaling.md shows them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleetserve.autoscaler.policy import make_policy

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "autoscaling").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_example_policy_loads_with_every_knob_it_sets(path):
    spec = yaml.safe_load(path.read_text())
    config = make_policy(spec).config
    knobs = {key: value for key, value in spec.items() if key not in ("policy", "limits")}
    assert {key: getattr(config, key) for key in knobs} == knobs
    assert {key: getattr(config.limits, key) for key in spec.get("limits", {})} == spec.get("limits", {})
