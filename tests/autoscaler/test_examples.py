"""The example autoscaling blocks load with every knob they set, in the simulator and in the platform
config alike, as docs/autoscaling.md shows them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleetserve.autoscaler.policies import POLICIES, make_policy
from fleetserve.platform.config import AutoscalingConfig, parse_config, parse_section

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "autoscaling").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_example_policy_loads_with_every_knob_it_sets(path):
    spec = yaml.safe_load(path.read_text())
    policy = make_policy(parse_section(AutoscalingConfig, spec, str(path)))
    assert type(policy) is POLICIES[spec["policy"]]
    assert policy.config.model_dump(include=set(spec)) == spec


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_example_pastes_into_the_platform_config_unchanged(path):
    spec = yaml.safe_load(path.read_text())
    model = parse_config({"models": [{"name": "m", "source": "x", "autoscaling": spec}]}).models[0]
    assert model.autoscaling == AutoscalingConfig.model_validate(spec)
