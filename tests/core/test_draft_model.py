"""A speculative decoding draft's weights come from the same kinds of source as a model's own, through the store."""

from __future__ import annotations

import pytest

from factories import model_entry
from fleetserve.platform.config import ModelConfig, load_config
from fleetserve.platform.config.paths import config_paths
from fleetserve.platform.model_store import HubFetch, ModelSourceError, with_local_draft


def draft_model(**spec: object) -> ModelConfig:
    return ModelConfig.model_validate(model_entry(speculative_config={"num_speculative_tokens": 2, **spec}))


@pytest.mark.parametrize(("spec", "source"), [
    ({"model": "acme/draft"}, "acme/draft"),
    ({"method": "eagle3", "model": "acme/eagle-head"}, "acme/eagle-head"),
    ({"method": "ngram", "prompt_lookup_max": 3}, None),
    ({"method": "suffix"}, None),
    ({"method": "custom_class", "model": "my_pkg.Proposer"}, None),
])
def test_draft_source_is_the_draft_weights_only(spec, source):
    assert draft_model(**spec).draft_source == source


def test_a_draft_without_speculative_decoding_is_none():
    assert ModelConfig.model_validate(model_entry()).draft_source is None


def test_a_hub_draft_has_its_own_revision_and_the_models_token_and_folder(tmp_path):
    entry = model_entry(speculative_config={"model": "acme/draft", "revision": "d1"},
                        extra={"revision": "v2", "hf_token": "hf_secret", "download_dir": str(tmp_path)})
    model = ModelConfig.model_validate({**entry, "source": "acme/target"})
    assert model.draft_hub_fetch == HubFetch("d1", "hf_secret", str(tmp_path))


def test_a_local_draft_replaces_the_source_in_a_copy(tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    model = draft_model(model=str(folder))
    local = with_local_draft(model)
    assert local.engine_args.speculative_config == {"num_speculative_tokens": 2, "model": str(folder)}
    assert local is not model


def test_a_missing_draft_is_refused_naming_its_key(tmp_path):
    with pytest.raises(ModelSourceError, match=r"models\[tiny\]\.engine_args\.speculative_config\.model: "
                                               r"model source .*nowhere.* not found"):
        with_local_draft(draft_model(model=str(tmp_path / "nowhere")))


def test_a_relative_draft_is_found_beside_the_config_and_listed_as_a_path(tmp_path):
    (tmp_path / "weights" / "draft").mkdir(parents=True)
    config_file = tmp_path / "platform.yaml"
    config_file.write_text("models:\n- name: m\n  source: tiny-random-llama\n  engine_args:\n"
                           "    speculative_config: {model: weights/draft, num_speculative_tokens: 2}\n")
    model = load_config(config_file).models[0]
    draft = str((tmp_path / "weights" / "draft").resolve())
    assert model.engine_args.speculative_config["model"] == draft
    assert [(path.key, path.path) for path in config_paths(load_config(config_file))] == [
        ("models[m].engine_args.speculative_config.model", draft)]


def test_a_packaged_draft_keeps_its_id_in_the_config(tmp_path):
    (tmp_path / "tiny-random-llama").mkdir()  # a folder of that name does not shadow the packaged id
    config_file = tmp_path / "platform.yaml"
    config_file.write_text("models:\n- name: m\n  source: tiny-random-llama\n  engine_args:\n"
                           "    speculative_config: {model: tiny-random-llama, num_speculative_tokens: 2}\n")
    config = load_config(config_file)
    assert config.models[0].draft_source == "tiny-random-llama"
    assert config_paths(config) == []


def test_build_app_hands_the_engine_deployment_the_resolved_draft():
    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import parse_config
    from fleetserve.platform.model_store import resolve_source

    config = parse_config({"models": [model_entry(speculative_config={"model": "tiny-random-llama",
                                                                      "num_speculative_tokens": 2})]})
    engines = build_app(config)._bound_deployment.init_args[0]
    bound_model = engines["tiny"]._bound_deployment.init_args[0]
    assert bound_model.engine_args.speculative_config == {"model": str(resolve_source("tiny-random-llama")),
                                                          "num_speculative_tokens": 2}
    assert config.models[0].draft_source == "tiny-random-llama"  # the config the ingress keeps is unchanged


def test_bare_vllm_serve_gets_the_resolved_draft_too():
    import json

    from fleetserve.platform.model_store import resolve_source
    from fleetserve.platform.openai_app import vllm_serve_command

    command = vllm_serve_command(draft_model(model="tiny-random-llama"))
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"num_speculative_tokens": 2, "model": str(resolve_source("tiny-random-llama"))}


def test_the_config_file_builder_leaves_sources_to_the_replicas(monkeypatch):
    from fleetserve.deployments import builders

    def fetched_here(*args, **kwargs):
        raise AssertionError("the builder's node fetched a model source")

    monkeypatch.setattr(builders, "resolve_source", fetched_here)
    app = builders.app_builder({"platform": {"models": [model_entry(source="acme/llama-8b", speculative_config={
        "model": "acme/llama-1b", "num_speculative_tokens": 2})]}})
    engines = app._bound_deployment.init_args[0]
    bound = engines["tiny"]._bound_deployment.init_args
    # (model, cpu bindings, model path, ...): no path, so the replica resolves the Hub id (and the draft) itself.
    assert (bound[0].source, bound[2], bound[0].engine_args.speculative_config["model"]) == (
        "acme/llama-8b", None, "acme/llama-1b")
