"""A replica on part of a GPU gets its part of vLLM's memory budget, since Ray packs such replicas onto one GPU."""

import pytest

from fleetserve.platform.config import ConfigError, parse_config
from fleetserve.platform.engine import shared_gpu_defaults


def model(num_gpus: float, disaggregated: bool = False, **extra):
    pools = {"disaggregation": {"prefill": {"replicas": 1, "engine_args": {"extra": extra}},
                                "decode": {"replicas": 1}}} if disaggregated else {}
    engine_args = {} if disaggregated else {"engine_args": {"extra": extra}}
    return parse_config({"models": [{"name": "m", "source": "tiny-random-llama", "resources": {"num_gpus": num_gpus},
                                     **engine_args, **pools}]}).models[0]


def test_a_quarter_gpu_gets_a_quarter_of_vllms_default_memory_budget():
    config = model(0.25)
    # vLLM's default gpu_memory_utilization is 0.92: 0.25 x 0.92 = 0.23, so four engines fit where one would.
    assert shared_gpu_defaults(config, config.engine_kwargs(), on_cpu=False)["gpu_memory_utilization"] == 0.23


@pytest.mark.parametrize(("config", "on_cpu"), [
    (model(1), False),  # a whole GPU: vLLM's default
    (model(0.5), True),  # CPU engines size their KV by bytes
    (model(0.5, gpu_memory_utilization=0.4), False),  # the user's choice, within the share
], ids=["whole-gpu", "cpu", "chosen"])
def test_whole_gpus_cpus_and_explicit_budgets_are_left_alone(config, on_cpu):
    kwargs = config.engine_kwargs()
    assert shared_gpu_defaults(config, kwargs, on_cpu=on_cpu) == kwargs


@pytest.mark.parametrize(("disaggregated", "where"), [(False, ""), (True, "disaggregation.prefill.")])
def test_a_budget_past_the_replicas_share_is_refused(disaggregated, where):
    with pytest.raises(ConfigError, match=rf"{where}engine_args.extra.gpu_memory_utilization 0.9 is more than "
                                          r"resources.num_gpus 0.5: .* Set it at most 0.5"):
        model(0.5, disaggregated, gpu_memory_utilization=0.9)
