"""What `fleetserve apply` changes: the config diff, and which deployments keep their Serve version."""

import pytest
from factories import model_entry, peft_folder

from fleetserve.deployments.builders import _engine_version
from fleetserve.platform.config import ServerConfig, parse_config
from fleetserve.platform.config.diff import diff_configs
from fleetserve.platform.engine import Engine


def config(*entries, **sections):
    return parse_config({"models": list(entries), **sections})


def test_diff_names_added_removed_and_changed_models_with_their_keys():
    running = config(model_entry("a"), model_entry("b"), {**model_entry("c"), "replicas": 1})
    applied = config(model_entry("a"), {**model_entry("c"), "replicas": 2}, model_entry("d", max_model_len=512),
                     limits={"max_tokens": 64})
    change = diff_configs(running, applied)
    assert (change.added, change.removed, change.changed, change.sections) == (["d"], ["b"], {"c": ["replicas"]},
                                                                               ["limits"])
    assert not change.restarts("c")  # a replica count changes in place
    assert change.describe() == ["+ d: start", "- b: stop", "~ c: replicas (in place)", "~ limits"]


def test_turning_on_the_batch_api_is_a_change_of_its_section():
    change = diff_configs(config(model_entry("a")), config(model_entry("a"), batches={}))
    assert (change.sections, change.changed, change.describe()) == (["batches"], {}, ["~ batches"])


def test_engine_args_restart_a_model_and_nothing_else_does():
    running = config(model_entry("a"))
    applied = config(model_entry("a", max_model_len=512))
    change = diff_configs(running, applied)
    assert change.changed == {"a": ["engine_args"]} and change.restarts("a")
    assert diff_configs(running, running).is_empty


def test_serve_version_ignores_replica_counts_and_follows_what_shapes_replicas():
    one, two = config({**model_entry("a"), "replicas": 1}), config({**model_entry("a"), "replicas": 2})
    shorter = config(model_entry("a", max_model_len=512))

    def version(cfg, binding=("0",), others=None, fast_path=True):
        bindings = {"engine-a": list(binding), **(others or {})}
        return _engine_version(cfg.models[0], bindings, "/models/a", Engine, ServerConfig(serve_fast_path=fast_path))

    assert version(one) == version(two)          # Serve scales it in place
    assert version(one) != version(shorter)      # new engine args: new replicas
    assert version(one) != version(one, ("1",))  # another core binding: new replicas
    assert version(one) == version(one, others={"engine-b": ["1"]})  # another model added: untouched
    assert version(one) != version(one, fast_path=False)  # Serve's options are read as a replica starts


def test_adapters_alone_change_in_place_and_keep_the_engine_version():
    def lora(*adapter_ids, max_loras=1):
        return config({**model_entry("a"), "lora": {"max_loras": max_loras, "adapters": [
            {"name": f"a-{i}", "source": f"random-lora:{i}"} for i in adapter_ids]}})

    def version(cfg):
        return _engine_version(cfg.models[0], {"engine-a": ["0"]}, "/models/a", Engine, ServerConfig())

    change = diff_configs(lora(1), lora(1, 2))
    assert change.changed == {"a": ["lora.adapters"]} and not change.restarts("a")
    assert change.describe() == ["~ a: lora.adapters (in place)"]
    assert version(lora(1)) == version(lora(1, 2))  # the replicas stay and load a-2 from the registry
    more_slots = diff_configs(lora(1), lora(1, 2, max_loras=2))
    assert more_slots.changed == {"a": ["lora"]} and more_slots.restarts("a")  # an engine arg of vLLM's
    assert version(lora(1)) != version(lora(1, max_loras=2))


def test_a_new_adapter_root_restarts_the_replicas_that_load_from_it():
    def rooted(root):
        return config({**model_entry("a"), "lora": {"adapter_root": root,
                                                    "adapters": [{"name": "a-1", "source": "random-lora:1"}]}})

    def version(cfg):
        return _engine_version(cfg.models[0], {"engine-a": ["0"]}, "/models/a", Engine, ServerConfig())

    change = diff_configs(rooted(None), rooted("s3://b/a"))
    assert change.changed == {"a": ["lora"]} and change.restarts("a")
    assert version(rooted(None)) != version(rooted("s3://b/a"))


def test_apply_refuses_an_adapter_source_that_cannot_load_before_deploying(monkeypatch, tmp_path):
    from fleetserve.deployments import apply
    from fleetserve.deployments.app_layout import AppLayout
    from fleetserve.platform.config import ConfigError

    def lora(source):
        return config({**model_entry("a"), "lora": {"adapters": [{"name": "a-1", "source": "random-lora:1"},
                                                                 {"name": "a-2", "source": source}]}})

    monkeypatch.setattr(apply, "running_config", lambda app_name: lora("random-lora:2"))
    monkeypatch.setattr(apply, "running_layout", lambda app_name: AppLayout.DRIVER_SOURCES)
    assert apply.plan_change(lora(str(peft_folder(tmp_path / "ok")))).changed == {"a": ["lora.adapters"]}
    # Before, each replica failed to load it in turn, and apply waited 60 s to say so.
    with pytest.raises(ConfigError, match=r"models\[a\]\.lora\.adapters\[a-2\]: adapter source '/no/adapter' not "
                                          r"found: expected a PEFT adapter folder"):
        apply.plan_change(lora("/no/adapter"))
    with pytest.raises(ConfigError, match=r"adapter source 'random-lora:x': expected random-lora:<seed>"):
        apply.plan_change(lora("random-lora:x"))
    # The model's max_lora_rank is vLLM's default, 16.
    with pytest.raises(ConfigError, match=r"adapters\[a-2\]: adapter folder .*: LoRA rank 32 is greater than "
                                          r"max_lora_rank 16\."):
        apply.plan_change(lora(str(peft_folder(tmp_path / "big", r=32))))


def test_apply_keeps_the_port_serve_was_started_on_unless_the_file_names_one(monkeypatch):
    from fleetserve.deployments import apply
    from fleetserve.deployments.app_layout import AppLayout
    from fleetserve.platform.config import ConfigError

    # `fleetserve serve platform.yaml --port 9000`: the running config names the port it listens on.
    running = config(model_entry("a"), server={"num_ingress_replicas": 1}).listening_at(port=9000)
    assert (running.server.host, running.server.port, running.server.num_ingress_replicas) == ("127.0.0.1", 9000, 1)
    monkeypatch.setattr(apply, "running_config", lambda app_name: running)
    monkeypatch.setattr(apply, "running_layout", lambda app_name: AppLayout.DRIVER_SOURCES)
    assert apply.plan_change(config(model_entry("a"), server={"num_ingress_replicas": 1})).is_empty
    assert apply.listening_as_running(config(model_entry("a")), running).server.port == 9000
    with pytest.raises(ConfigError, match="server: port cannot change while the platform runs"):
        apply.plan_change(config(model_entry("a"), server={"port": 8001}))
