"""config_paths: every file or folder a platform config names, and which of them no pod volume holds."""

from __future__ import annotations

import yaml

from fleetserve.platform.config import load_config, parse_config
from fleetserve.platform.config.paths import ConfigPath, config_paths, outside
from tests.factories import model_entry


def test_config_paths_lists_local_paths_and_leaves_out_packaged_hub_and_inline_sources(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    config = parse_config({
        "models": [
            {**model_entry("local", str(folder), speculative_config={"model": "/drafts/small"},
                           extra={"tokenizer": "/tokenizers/local"}),
             "api": {"chat_template": "/templates/chatml.jinja"}},
            {**model_entry("hub", "HuggingFaceTB/SmolLM2-135M-Instruct", speculative_config={"model": "acme/draft"},
                           extra={"tokenizer": "acme/tokenizer"}), "api": {"chat_template": "{{ messages }}"}},
            {**model_entry("tiny"), "lora": {"adapters": [{"name": "seeded", "source": "random-lora:3"},
                                                          {"name": "tuned", "source": "/adapters/tuned"}],
                                             "adapter_root": "/adapters/tiny"}},
            {**model_entry("stored"), "lora": {"adapter_root": "s3://adapters/stored"}},
        ],
        "model_routing": {"checkpoints": {"mlp": "/routers/mlp"}, "tiers": ["tiny", "local"],
                          "routes": [{"name": "auto", "router": "mlp", "strong_fraction": 0.3}],
                          "recording": {"directory": "/var/log/routed"}},
        "auth": {"api_keys_file": "/etc/fleetserve/api-keys.yaml"},
    })
    assert config_paths(config) == [
        ConfigPath("models[local].source", str(folder)),
        ConfigPath("models[local].engine_args.speculative_config.model", "/drafts/small"),
        ConfigPath("models[local].engine_args.extra.tokenizer", "/tokenizers/local"),
        ConfigPath("models[local].api.chat_template", "/templates/chatml.jinja"),
        ConfigPath("models[tiny].lora.adapters[tuned].source", "/adapters/tuned"),
        ConfigPath("models[tiny].lora.adapter_root", "/adapters/tiny"),
        ConfigPath("model_routing.checkpoints.mlp", "/routers/mlp"),
        ConfigPath("model_routing.recording.directory", "/var/log/routed"),
        ConfigPath("auth.api_keys_file", "/etc/fleetserve/api-keys.yaml"),
    ]


def test_config_paths_are_the_loaded_configs_absolute_ones(tmp_path):
    (tmp_path / "tokenizers" / "big").mkdir(parents=True)
    (tmp_path / "adapters").mkdir()
    path = tmp_path / "routed.yaml"
    path.write_text(yaml.safe_dump({
        "models": [{**model_entry("tiny"), "lora": {"adapter_root": "adapters"}},
                   model_entry("big", extra={"tokenizer": "tokenizers/big"})],
        "model_routing": {"checkpoints": {"mlp": "routers/mlp"}, "tiers": ["tiny", "big"],
                          "routes": [{"name": "auto", "router": "mlp", "strong_fraction": 0.3}]}}))
    assert config_paths(load_config(path)) == [
        ConfigPath("models[tiny].lora.adapter_root", str(tmp_path / "adapters")),
        ConfigPath("models[big].engine_args.extra.tokenizer", str(tmp_path / "tokenizers" / "big")),
        ConfigPath("model_routing.checkpoints.mlp", str(tmp_path / "routers" / "mlp"))]


def test_outside_keeps_paths_under_no_mount_and_every_relative_one():
    paths = [ConfigPath("a", "/models/routers/mlp"), ConfigPath("b", "/models-old/x"), ConfigPath("c", "routers/mf"),
             ConfigPath("d", "/etc/fleetserve/api-keys.yaml"), ConfigPath("e", "/models/../srv/x")]
    # /models-old is not under /models; /models/../srv is /srv; a relative path resolves in the pod's working
    # directory, which no mount is.
    assert outside(paths, ["/models/", "/etc/fleetserve"]) == [paths[1], paths[2], paths[4]]
