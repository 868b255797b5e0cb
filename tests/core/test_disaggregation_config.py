"""Disaggregation config: pools derive their own configs; bad combinations are clear errors."""

import pytest

from fleetserve.deployments.serve_options import deployment_name, deployment_options
from fleetserve.platform.config import ConfigError, parse_config


def pd_model(**disaggregation) -> dict:
    return {"name": "m", "source": "x", "engine_args": {"dtype": "float32", "max_model_len": 1024},
            "disaggregation": disaggregation}


def test_pools_take_their_own_replicas_args_routing_and_autoscaling():
    config = parse_config({"models": [pd_model(
        prefill={"replicas": 2, "engine_args": {"max_num_batched_tokens": 4096}},
        decode={"replicas": 3, "autoscaling": {"max_replicas": 6}}, min_prompt_tokens=64)]})
    model = config.models[0]
    prefill, decode = model.pool_model("prefill"), model.pool_model("decode")
    assert model.pools() == ("prefill", "decode")
    assert (deployment_name(prefill), deployment_name(decode)) == ("prefill-m", "engine-m")
    assert (prefill.replicas, decode.replicas) == (2, 3)
    # The prefill override is merged over the model's args; decode keeps the model's.
    assert prefill.engine_args.max_num_batched_tokens == 4096 and decode.engine_args.max_num_batched_tokens is None
    assert prefill.engine_args.dtype == decode.engine_args.dtype == "float32"
    # Prefill follows the model's routing (cache-aware by default); decode is routed by load.
    assert (prefill.routing.policy, decode.routing.policy) == ("cache_aware", "least_loaded")
    assert prefill.autoscaling is None and decode.autoscaling.pool == "decode"
    assert deployment_options(decode, config.server)["autoscaling_config"]["max_replicas"] == 6
    assert deployment_options(prefill, config.server)["num_replicas"] == 2
    assert model.disaggregation.min_prompt_tokens == 64


def test_colocated_is_the_default():
    model = parse_config({"models": [{"name": "m", "source": "x"}]}).models[0]
    assert model.pools() == ("colocated",) and model.pool_model("colocated") is model
    with pytest.raises(ValueError, match=r"runs pools \('colocated',\), not 'prefill'"):
        model.pool_model("prefill")


@pytest.mark.parametrize(("model", "expected"), [
    ({**pd_model(), "replicas": 2}, "with disaggregation, set replicas and autoscaling per pool"),
    ({**pd_model(), "autoscaling": {}}, "with disaggregation, set replicas and autoscaling per pool"),
    (pd_model(decode={"engine_args": {"dtype": "bfloat16"}}),
     "must agree on the KV layout; they differ in {'dtype': ('float32', 'bfloat16')}"),
    (pd_model(prefill={"engine_args": {"max_num_seqs": 0}}),
     "disaggregation.prefill.engine_args: max_num_seqs: Input should be greater than 0"),
    (pd_model(prefill={"engine_args": {"extra": {"kv_transfer_config": {}}}}),
     "disaggregation.prefill.engine_args: kv_transfer_config is set by the platform"),
    ({**pd_model(), "engine_args": {"extra": {"kv_transfer_config": {}}}},
     "engine_args.extra.kv_transfer_config: the platform sets the KV connector"),
    # vLLM would swap the platform's NIXL connector for its offloading one: decode engines would get no KV.
    ({**pd_model(), "engine_args": {"extra": {"kv_offloading_size": 8}}},
     "engine_args.extra.kv_offloading_size: vLLM's KV offloading replaces the NIXL connector"),
    (pd_model(decode={"engine_args": {"extra": {"kv_offloading_backend": "lmcache"}}}),
     "disaggregation.decode.engine_args.extra.kv_offloading_backend: vLLM's KV offloading replaces the NIXL"),
    (pd_model(decode={"engine_args": {"extra": {"served_model_name": ["d"]}}}),
     "disaggregation.decode.engine_args.extra.served_model_name: clients call the model by its name"),
    (pd_model(prefill={"engine_args": {"extra": {"pipeline_parallel_size": 2}}}),
     "disaggregation.prefill.engine_args.extra.pipeline_parallel_size: a replica runs on one node"),
    (pd_model(decode={"autoscaling": {"pool": "prefill"}}), "disaggregation.decode.autoscaling.pool is 'prefill'"),
    (pd_model(connector="mooncake"), "models.0.disaggregation.connector: Input should be 'nixl'"),
    (pd_model(min_prompt_tokens=-1), "models.0.disaggregation.min_prompt_tokens: Input should be greater than"),
    (pd_model(prefill={"replicas": 0}),
     "models.0.disaggregation.prefill: Value error, replicas: 0 starts the pool with no replica, which only"),
])
def test_bad_combinations_are_clear_errors(model, expected):
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": [model]})
    assert expected in str(caught.value)


def test_pools_can_ask_for_their_own_slices():
    config = parse_config({"models": [{**pd_model(prefill={"custom_resources": {"mig-3g.71gb": 1}},
                                                  decode={"cpu_binding": ["1"]}),
                                       "resources": {"num_cpus": 0.5, "custom_resources": {"mig-1g.18gb": 1}}}]})
    model = config.models[0]
    prefill, decode = model.pool_model("prefill"), model.pool_model("decode")
    # Prefill's slice replaces the model's; decode keeps the model's slice and CPU, with its own cores.
    assert deployment_options(prefill, config.server)["ray_actor_options"] == {
        "num_cpus": 0.5, "num_gpus": 0, "resources": {"mig-3g.71gb": 1}}
    assert deployment_options(decode, config.server)["ray_actor_options"] == {
        "num_cpus": 0.5, "num_gpus": 0, "resources": {"mig-1g.18gb": 1}}
    assert decode.resources.cpu_binding == ["1"] and prefill.resources.cpu_binding is None
