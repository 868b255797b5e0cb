"""Platform config: valid files load; every error names its key and what was expected."""

from pathlib import Path

import pytest

from fleetserve.deployments.serve_options import deployment_options
from fleetserve.platform.config import ConfigError, ServerConfig, default_config, load_config, parse_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_examples_load():
    names = {path.name: load_config(path) for path in EXAMPLES.glob("*.yaml")}
    assert {"tiny.yaml", "two-models.yaml"} <= set(names)
    assert [model.name for model in names["two-models.yaml"].models] == ["smollm2", "tiny"]


def test_default_config_serves_smollm2():
    config = default_config()
    assert [model.source for model in config.models] == ["smollm2-135m-instruct"]
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)


def test_engine_args_pass_through_to_vllm_kwargs():
    config = parse_config({"models": [{"name": "m", "source": "x", "engine_args": {
        "max_model_len": 512, "max_num_seqs": 4, "stream_interval": 4, "extra": {"enforce_eager": True}}}]})
    kwargs = config.models[0].engine_args.to_vllm_kwargs()
    # Unset optional fields (block_size, quantization, ...) are left to vLLM's defaults.
    assert kwargs["max_model_len"] == 512 and kwargs["max_num_seqs"] == 4 and kwargs["enforce_eager"] is True
    assert kwargs["stream_interval"] == 4
    assert "block_size" not in kwargs and "quantization" not in kwargs


def test_deployment_options_come_from_config():
    config = parse_config({"models": [{"name": "m", "source": "x", "replicas": 3,
                                       "resources": {"num_cpus": 2, "num_gpus": 1}}]})
    options = deployment_options(config.models[0], config.server)
    assert options["name"] == "engine-m" and options["num_replicas"] == 3
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}


@pytest.mark.parametrize("fast_path", [False, True])
def test_a_models_env_vars_reach_its_replicas_runtime_env_beside_serves(fast_path):
    from fleetserve.deployments.serve_options import FAST_PATH_ENV

    config = parse_config({"models": [{"name": "m", "source": "x", "env_vars": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}}],
                           "server": {"serve_fast_path": fast_path}})
    options = deployment_options(config.models[0], config.server)
    expected = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", **(FAST_PATH_ENV if fast_path else {})}
    assert options["ray_actor_options"]["runtime_env"] == {"env_vars": expected}


@pytest.mark.parametrize(("name", "reason"), [
    ("VLLM_CPU_OMP_THREADS_BIND", "set resources.cpu_binding"),
    ("CUDA_VISIBLE_DEVICES", "set resources.num_gpus"),
    ("VLLM_NIXL_SIDE_CHANNEL_PORT", "KV transfer"),
    ("RAY_SERVE_USE_GRPC_BY_DEFAULT", "the cluster's, not one model's"),
])
def test_env_vars_the_platform_sets_are_refused_naming_why(name, reason):
    with pytest.raises(ConfigError, match=rf"env_vars\.{name}: .*{reason}"):
        parse_config({"models": [{"name": "m", "source": "x", "env_vars": {name: "1"}}]})


@pytest.mark.parametrize(("model", "expected"), [
    ({}, 2048),  # vLLM picks max_num_seqs, up to 1024 (an H100 API server's): twice that
    ({"engine_args": {"max_num_seqs": 64}}, 256),  # twice 64 is 128: at least 256
    ({"engine_args": {"max_num_seqs": 512}}, 1024),  # twice 512
    ({"engine_args": {"max_num_seqs": 512}, "max_ongoing_requests": 600}, 600),  # the config's
])
def test_a_replica_holds_more_requests_than_its_engine_runs(model, expected):
    config = parse_config({"models": [{"name": "m", "source": "x", **model}]})
    assert deployment_options(config.models[0], config.server)["max_ongoing_requests"] == expected


def test_a_replica_that_could_never_fill_its_engines_batch_is_refused():
    pools = {"prefill": {"replicas": 1, "engine_args": {"max_num_seqs": 300}}, "decode": {"replicas": 1}}
    with pytest.raises(ConfigError, match="max_ongoing_requests 256 is below the prefill engine's max_num_seqs 300"):
        parse_config({"models": [{"name": "m", "source": "x", "max_ongoing_requests": 256, "disaggregation": pools}]})


@pytest.mark.parametrize(("data", "expected"), [
    ({"models": [{"name": "m", "source": "x", "engine_args": {"max_model_lenn": 5}}]},
     "models.0.engine_args.max_model_lenn: unknown key"),
    ({"models": [{"name": "m", "source": "x", "engine_args": {"dtype": "fp7"}}]},
     "models.0.engine_args.dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32' (got 'fp7')"),
    ({"models": [{"name": "m", "source": "x", "engine_args": {"stream_interval": 0}}]},
     "models.0.engine_args.stream_interval: Input should be greater than or equal to 1 (got 0)"),
    ({"models": [{"name": "m", "source": "x", "replicas": -1}]},
     "models.0.replicas: Input should be greater than or equal to 0 (got -1)"),
    ({"models": [{"source": "x"}]}, "models.0.name: required key is missing"),
    ({"models": []}, "models: List should have at least 1 item"),
    ({"models": [{"name": "bad name", "source": "x"}]}, "models.0.name: Value error, expected 1-128 characters"),
    ({"models": [{"name": "org//name", "source": "x"}]}, "models.0.name: Value error, expected 1-128 characters"),
    ({"models": [{"name": "org/", "source": "x"}]}, "models.0.name: Value error, expected 1-128 characters"),
    ({"models": [{"name": "a" * 129, "source": "x"}]}, "models.0.name: Value error, expected 1-128 characters"),
    ({"models": [{"name": "org/m", "source": "x"}, {"name": "org--m", "source": "y"}]},
     "models 'org/m' and 'org--m' would share Serve deployments"),
    ({"models": [{"name": "m", "source": "x"}, {"name": "m", "source": "y"}]}, "model name 'm' appears twice"),
    ([1, 2], "expected a mapping with a 'models' list"),
])
def test_invalid_config_names_the_key(data, expected):
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert expected in str(caught.value)


def test_missing_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read platform config"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)


def test_extra_may_not_repeat_typed_keys():
    with pytest.raises(ConfigError, match=r"models.0.engine_args.extra: Value error, repeats typed keys \['max_model_len'\]"):
        parse_config({"models": [{"name": "m", "source": "x", "engine_args": {"extra": {"max_model_len": 5}}}]})


def test_routed_example_resolves_checkpoints_next_to_the_file():
    from fleetserve.router.model.routes import RouteTable

    from factories import synthetic_correctness

    from fleetserve.router.model.embedders import make_embedder
    from fleetserve.router.model.quality_router import train_router

    config = load_config(EXAMPLES / "routed.yaml")
    assert config.model_routing.checkpoints["mf"] == str((EXAMPLES / "routers" / "mmlu-mf-minilm").resolve())
    # The example's checkpoints are built by `make router-checkpoints`, not committed: stand-ins with
    # the MMLU models' names and a 0.3 calibration take their place.
    data = synthetic_correctness()
    data.models = ["mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"]
    routers = {}
    for kind, spec in (("mf", "hashing-256"), ("mlp", "difficulty")):
        routers[kind] = train_router(kind, data, make_embedder(spec))
        routers[kind].calibrate(data.prompts, 0.3)
    table = RouteTable(config.model_routing, routers=routers)
    assert table.names() == ["auto", "auto-mf"]
    assert table.resolve("auto").tiers == ("tiny", "smollm2")
    assert table.resolve("auto").out_of_domain_tier == 1  # smollm2
    assert table.resolve("auto").checkpoint_models == ("mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview")


@pytest.mark.parametrize(("model", "expected"), [
    ({"routing": {"policy": "round_robin", "prefix_source": "kv_events"}}, "policy round_robin ignores it"),
    ({"routing": {"prefix_source": "kv_events"}, "engine_args": {"enable_prefix_caching": False}},
     "needs engine_args.enable_prefix_caching"),
    ({"routing": {"prefix_source": "kv_events"}, "engine_args": {"extra": {"kv_events_config": {}}}},
     "the platform sets it"),
    ({"disaggregation": {"prefill": {"routing": {"prefix_source": "kv_events"}}, "decode": {}},
      "engine_args": {"extra": {"kv_events_config": {}}}}, "the platform sets it"),
])
def test_kv_event_routing_config_errors(model, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config({"models": [{"name": "m", "source": "tiny-random-llama", **model}]})


def test_a_prefill_pool_routed_on_kv_events_gets_the_engines_tokenizer_and_the_decode_pool_does_not():
    from fleetserve.deployments.builders import pool_options

    model = parse_config({"models": [{"name": "m", "source": "tiny-random-llama", "routing": {
        "prefix_source": "kv_events"}, "disaggregation": {"prefill": {}, "decode": {}}}]}).models[0]
    prefill = pool_options(model.pool_model("prefill"), "/models/m", ServerConfig())
    kwargs = prefill["request_router_config"]["request_router_kwargs"]
    assert (kwargs["routing"]["prefix_source"], kwargs["tokenizer_source"]) == ("kv_events", "/models/m")
    decode = pool_options(model.pool_model("decode"), "/models/m", ServerConfig())
    # The decode pool is routed least_loaded (its prompts' KV comes from the prefill pool): no tokenizer.
    decode_kwargs = decode["request_router_config"]["request_router_kwargs"]
    assert (list(decode_kwargs), decode_kwargs["routing"]["policy"]) == (["routing"], "least_loaded")


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, ("/models/m", None)),
    ({"tokenizer": "/tokenizers/m"}, ("/tokenizers/m", None)),
    ({"tokenizer": "acme/tokenizer", "tokenizer_revision": "v2"}, ("acme/tokenizer", "v2")),
])
def test_a_router_on_kv_events_tokenizes_with_the_engines_tokenizer(extra, expected):
    from fleetserve.deployments.builders import pool_options

    model = parse_config({"models": [{"name": "m", "source": "tiny-random-llama", "engine_args": {"extra": extra},
                                      "routing": {"prefix_source": "kv_events"}}]}).models[0]
    kwargs = pool_options(model, "/models/m", ServerConfig())["request_router_config"]["request_router_kwargs"]
    assert (kwargs["tokenizer_source"], kwargs["tokenizer_revision"]) == expected


def test_kv_event_routing_reaches_the_request_router():
    config = parse_config({"models": [{"name": "m", "source": "tiny-random-llama",
                                       "routing": {"prefix_source": "kv_events"}}]})
    kwargs = deployment_options(config.models[0], config.server)["request_router_config"]["request_router_kwargs"]
    assert (kwargs["routing"]["policy"], kwargs["routing"]["prefix_source"]) == ("cache_aware", "kv_events")


@pytest.mark.parametrize(("model", "expected"), [
    ({"engine_args": {"tensor_parallel_size": 2}, "resources": {"num_gpus": 1}},
     "resources.num_gpus is 1, but engine_args.tensor_parallel_size 2 needs one GPU per rank: set num_gpus to 2"),
    ({"engine_args": {"tensor_parallel_size": 2}, "resources": {"cpu_binding": ["0|1|2"]}},
     "entry '0|1|2' binds 3 ranks"),
    ({"engine_args": {"tensor_parallel_size": 2},
      "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}, "not supported for disaggregated"),
    ({"engine_args": {"tensor_parallel_size": 2}, "resources": {"num_gpus": 2, "custom_resources": {"mig-3g.40gb": 1}}},
     r"cannot run on MIG slices \(mig-3g.40gb\): tensor parallelism needs whole GPUs"),
    ({"engine_args": {"extra": {"tensor_parallel_size": 2}}}, r"repeats typed keys \['tensor_parallel_size'\]"),
    ({"engine_args": {"extra": {"pipeline_parallel_size": 2}}}, "a replica runs on one node"),
    ({"engine_args": {"extra": {"distributed_executor_backend": "ray"}}}, "multiprocessing executor"),
    ({"engine_args": {"tensor_parallel_size": 0}}, "greater than or equal to 1"),
])
def test_tensor_parallel_config_errors(model, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config({"models": [{"name": "m", "source": "x", **model}]})


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("model", "/models/other", "the platform gives vLLM the local folder of the model's source: set source"),
    ("served_model_name", ["alias"], "clients call the model by its name, and adapters by theirs: set name"),
    ("disable_log_stats", True, "the platform's metrics, admission control and autoscaling read every engine"),
])
def test_engine_args_the_platform_sets_are_refused_in_extra(key, value, reason):
    # Before, each was accepted and reached vLLM beside the platform's own: the replica failed at start with
    # "got multiple values for keyword argument".
    with pytest.raises(ConfigError, match=rf"models\.0: .*engine_args\.extra\.{key}: {reason}"):
        parse_config({"models": [{"name": "m", "source": "x", "engine_args": {"extra": {key: value}}}]})


def test_tensor_parallel_replica_asks_for_a_gpu_per_rank():
    config = parse_config({"models": [{"name": "m", "source": "x", "resources": {"num_gpus": 4},
                                       "engine_args": {"tensor_parallel_size": 4}}]})
    assert deployment_options(config.models[0], config.server)["ray_actor_options"]["num_gpus"] == 4
    assert config.models[0].engine_kwargs()["tensor_parallel_size"] == 4
    # One core set per rank, or one for the platform to split: both are accepted.
    for binding in (["0-1|2-3"], ["0-3"]):
        parse_config({"models": [{"name": "m", "source": "x", "resources": {"cpu_binding": binding},
                                  "engine_args": {"tensor_parallel_size": 2}}]})


def test_model_paths_beside_the_config_resolve_there_and_ids_stay_as_given(tmp_path, monkeypatch):
    import yaml

    configs = tmp_path / "configs"
    for folder in ("models/ft-1", "adapters/a", "smollm2-135m-instruct"):
        (configs / folder).mkdir(parents=True)
    (configs / "chatml.jinja").write_text("{{ messages }}")
    (configs / "platform.yaml").write_text(yaml.safe_dump({"models": [
        {"name": "ft", "source": "models/ft-1", "api": {"chat_template": "chatml.jinja"},
         "lora": {"adapters": [{"name": "a", "source": "adapters/a"}, {"name": "r", "source": "random-lora:1"}]}},
        # A packaged id wins over a folder of its name, as in the model store; a Hub id with no such folder,
        # inline Jinja and a path absent beside the config (from the working directory) stay as given.
        {"name": "packaged", "source": "smollm2-135m-instruct", "api": {"chat_template": "{{ '/' * 300 }}"}},
        {"name": "hub", "source": "HuggingFaceTB/SmolLM2-135M-Instruct", "api": {"chat_template": "x" * 300}},
        {"name": "cwd", "source": "elsewhere/model"},
    ]}))
    monkeypatch.chdir(tmp_path)  # the working directory is not the config's folder
    models = {model.name: model for model in load_config("configs/platform.yaml").models}
    assert models["ft"].source == str(configs / "models" / "ft-1")
    assert models["ft"].api.chat_template == str(configs / "chatml.jinja")
    assert [adapter.source for adapter in models["ft"].lora.adapters] == [str(configs / "adapters" / "a"),
                                                                          "random-lora:1"]
    assert (models["packaged"].source, models["packaged"].api.chat_template) == ("smollm2-135m-instruct",
                                                                                 "{{ '/' * 300 }}")
    assert (models["hub"].source, models["hub"].api.chat_template) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "x" * 300)
    assert models["cwd"].source == "elsewhere/model"


def test_hugging_face_ids_are_model_names_and_serve_deployments_spell_their_slash():
    from fleetserve.deployments.serve_options import deployment_name

    config = parse_config({"models": [{
        "name": "Qwen/Qwen2.5-0.5B-Instruct", "source": "tiny-random-llama",
        "lora": {"adapters": [{"name": "acme/sql-v2", "source": "random-lora:1"}]}}]})
    model = config.models[0]
    assert deployment_name(model) == "engine-Qwen--Qwen2.5-0.5B-Instruct"
    assert config.adapter_bases() == {"acme/sql-v2": "Qwen/Qwen2.5-0.5B-Instruct"}
