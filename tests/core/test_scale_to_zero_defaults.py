"""Engine args a pool that scales to zero gets by default: eager on CPU, where compiling lengthens every wake."""

import pytest

from fleetserve.platform.config import parse_config
from fleetserve.platform.engine import scale_to_zero_defaults


def model(min_replicas: int | None, **extra):
    autoscaling = ({"autoscaling": {"policy": "kv_cache", "min_replicas": min_replicas, "max_replicas": 2}}
                   if min_replicas is not None else {})
    return parse_config({"models": [{"name": "m", "source": "tiny-random-llama", "engine_args": {"extra": extra},
                                     **autoscaling}]}).models[0]


def test_a_pool_at_zero_on_cpu_runs_eagerly():
    config = model(0)
    assert scale_to_zero_defaults(config, config.engine_kwargs(), on_cpu=True)["enforce_eager"] is True


@pytest.mark.parametrize(("config", "on_cpu"), [
    (model(0), False),  # a GPU: compiling and CUDA graphs pay for themselves there
    (model(1), True),  # never at zero: compiled once per replica start
    (model(None), True),  # fixed replicas
    (model(0, enforce_eager=False), True),  # the user chose to compile
], ids=["gpu", "min-one", "no-autoscaling", "chosen"])
def test_the_default_leaves_other_pools_and_explicit_choices_alone(config, on_cpu):
    kwargs = config.engine_kwargs()
    assert scale_to_zero_defaults(config, kwargs, on_cpu=on_cpu) == kwargs


def test_a_pool_that_scales_to_zero_may_start_there():
    from fleetserve.deployments.serve_options import autoscaling_config

    config = parse_config({"models": [{"name": "m", "source": "tiny-random-llama", "replicas": 0, "autoscaling": {
        "policy": "kv_cache", "min_replicas": 0, "max_replicas": 2}}]}).models[0]
    assert autoscaling_config(config.autoscaling, config.replicas, config.name)["initial_replicas"] == 0


@pytest.mark.parametrize("autoscaling", [{}, {"autoscaling": {"policy": "kv_cache", "min_replicas": 1,
                                                              "max_replicas": 2}}], ids=["fixed", "min-one"])
def test_starting_at_zero_is_refused_where_nothing_would_wake_the_pool(autoscaling):
    from fleetserve.platform.config import ConfigError

    with pytest.raises(ConfigError, match=r"models\.0: .*replicas: 0 starts the model with no replica, which only a "
                                          r"pool that scales to zero wakes from"):
        parse_config({"models": [{"name": "m", "source": "tiny-random-llama", "replicas": 0, **autoscaling}]})


def pd_model(prefill: dict) -> dict:
    return {"name": "m", "source": "tiny-random-llama", "disaggregation": {"prefill": prefill}}


def test_a_prefill_pool_that_scales_to_zero_may_start_there():
    from fleetserve.deployments.serve_options import deployment_options
    from fleetserve.platform.config import ServerConfig

    config = parse_config({"models": [pd_model({"replicas": 0, "autoscaling": {
        "policy": "kv_cache", "min_replicas": 0, "max_replicas": 2}})]}).models[0]
    prefill = config.pool_model("prefill")
    assert prefill.replicas == 0
    assert deployment_options(prefill, ServerConfig())["autoscaling_config"]["initial_replicas"] == 0


@pytest.mark.parametrize("prefill", [{"replicas": 0}, {"replicas": 0, "autoscaling": {
    "policy": "kv_cache", "min_replicas": 1, "max_replicas": 2}}], ids=["fixed", "min-one"])
def test_a_pool_starting_at_zero_is_refused_where_nothing_would_wake_it(prefill):
    from fleetserve.platform.config import ConfigError

    with pytest.raises(ConfigError, match=r"models\.0\.disaggregation\.prefill: .*replicas: 0 starts the pool with no "
                                          r"replica, which only a pool that scales to zero wakes from"):
        parse_config({"models": [pd_model(prefill)]})
