"""Model store: packaged ids, folders and GGUF files resolve to loadable HF folders; bad sources are clear."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import hub_app
from fleetserve.platform import model_store
from fleetserve.platform.model_store import HubFetch, ModelSourceError, SourceKind, resolve_source, source_kind


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tiny_random_llama_is_built_once_and_loads(cache):
    from transformers import AutoConfig, AutoTokenizer

    folder = resolve_source("tiny-random-llama")
    assert folder.parent.parent == cache
    mtime = (folder / "model.safetensors").stat().st_mtime
    assert resolve_source("tiny-random-llama") == folder  # cached: not rebuilt
    assert (folder / "model.safetensors").stat().st_mtime == mtime
    config = AutoConfig.from_pretrained(folder)
    assert (config.head_dim, config.num_hidden_layers) == (64, 2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "Return the number of items in a container."
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level BPE round-trips
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_build_is_deterministic(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        model_store.build_tiny_random_llama(tmp_path / name)
    assert model_store.file_sha256(tmp_path / "a" / "model.safetensors") == \
        model_store.file_sha256(tmp_path / "b" / "model.safetensors")
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_smollm2_gguf_converts_to_dense_bf16_with_chat_template():
    folder = resolve_source("smollm2-135m-instruct")  # cached across runs by the GGUF's hash
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    # 134.5M parameters x 2 bytes (bf16), tied embeddings stored once.
    assert 260e6 < (folder / "model.safetensors").stat().st_size < 280e6
    assert "im_start" in (folder / "chat_template.jinja").read_text()


def test_hf_folder_is_used_in_place(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_source(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p / "nothing-here", "not found: expected a HF folder, a .gguf file, a folder in object storage "
                                   r"\(s3://, gs://, az://\), or one of the packaged ids"),
    (lambda p: p, "has no config.json"),
    (lambda p: (p / "weights.bin").write_text("x") and p / "weights.bin", "is a file but not a .gguf"),
])
def test_bad_sources_say_what_was_expected(tmp_path, make, message):
    with pytest.raises(ModelSourceError, match=message):
        resolve_source(str(make(tmp_path)))


def test_source_kind_takes_packaged_ids_then_existing_paths_then_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "local").mkdir(parents=True)
    assert source_kind("smollm2-135m-instruct") is SourceKind.PACKAGED
    assert source_kind("acme/local") is SourceKind.PATH       # a folder here wins over the Hub id it spells
    assert source_kind("acme/remote") is SourceKind.HUB
    assert source_kind("models/ft/v2") is SourceKind.PATH     # two slashes: not a Hub id
    assert source_kind("missing") is SourceKind.PATH


def test_a_hub_id_resolves_to_its_cached_snapshot_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    # Hugging Face's cache layout: refs/main names the snapshot folder of the main revision.
    repo = tmp_path / "models--acme--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # as on a node without Hub access
    assert resolve_source("acme/tiny") == snapshot


def test_a_pinned_revision_resolves_to_that_revisions_snapshot(tmp_path, monkeypatch):
    # refs/<name> names each revision's snapshot folder; before, every source resolved to refs/main's whatever
    # engine_args.extra.revision said, and vLLM ignores a revision once the model is a local folder.
    repo = tmp_path / "models--acme--tiny"
    for ref, commit in (("main", "c0ffee"), ("v1", "abc123")):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert resolve_source("acme/tiny", hub=HubFetch(revision="v1")) == repo / "snapshots" / "abc123"
    assert resolve_source("acme/tiny") == repo / "snapshots" / "c0ffee"


def test_a_revision_for_a_source_without_revisions_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"is no Hugging Face Hub id, so it has no revision 'v1': remove "
                                               r"engine_args\.extra\.revision"):
        resolve_source(str(tmp_path), hub=HubFetch(revision="v1"))


@pytest.mark.parametrize(("extra", "refused"), [
    ({"tokenizer_revision": "v2"}, "tokenizer_revision"),
    ({"revision": "v1", "code_revision": "v2"}, "code_revision"),
    ({"revision": "v1", "tokenizer_revision": "v1"}, None),
    # A tokenizer of its own comes at its own revision.
    ({"revision": "v1", "tokenizer": "acme/tokenizer", "tokenizer_revision": "v2"}, None),
    ({"revision": "v1", "tokenizer": "acme/tokenizer", "code_revision": "v2"}, "code_revision"),
])
def test_a_tokenizer_or_code_revision_apart_from_the_models_is_refused(extra, refused):
    from fleetserve.platform.config import ConfigError, parse_config

    data = {"models": [{"name": "m", "source": "acme/tiny", "engine_args": {"extra": extra}}]}
    if refused is None:
        assert parse_config(data).models[0].source_revision == "v1"
        return
    with pytest.raises(ConfigError, match=rf"engine_args\.extra\.{refused}: the model's files come from one "
                                          rf"revision of its source"):
        parse_config(data)


def test_a_hub_id_neither_the_hub_nor_the_cache_has_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError, match=r"could not be fetched .*`huggingface-cli download "
                                               r"meta-llama/Llama-3.1-8B-Instruct --local-dir DIR`.*HF_TOKEN"):
        resolve_source("meta-llama/Llama-3.1-8B-Instruct")


HUB_FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights", "tokenizer.json": b"{}",
             "pytorch_model.bin": b"the same weights, pickled"}


def resolve_in_a_fresh_process(hub_url: str, cache: Path, config_only: bool = False, hub: str = "HubFetch()") -> Path:
    # huggingface_hub reads its endpoint when imported: a process of its own, as a replica resolves its source.
    script = ("import sys; from fleetserve.platform.model_store import HubFetch, resolve_source; "
              f"print(resolve_source('acme/tiny', config_only={config_only}, hub={hub}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    return Path(done.stdout.strip().splitlines()[-1])


def test_a_hub_id_downloads_its_serving_files_once(tmp_path, loopback_server):
    fetched: list[str] = []
    with loopback_server(hub_app("acme/tiny", HUB_FILES, fetched)) as hub:
        folder = resolve_in_a_fresh_process(hub.url, tmp_path / "hub")
        # Config, safetensors and tokenizer; not the pickled copy of the same weights.
        assert sorted(path.name for path in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
        assert (folder / "model.safetensors").read_bytes() == b"weights"
        assert sorted(fetched) == ["config.json", "model.safetensors", "tokenizer.json"]
        assert resolve_in_a_fresh_process(hub.url, tmp_path / "hub") == folder
        assert len(fetched) == 3  # the second resolve found them in the cache
        # The planner reads a model's shape: its JSON files only, never the weights.
        planned = resolve_in_a_fresh_process(hub.url, tmp_path / "plan", config_only=True)
    assert sorted(path.name for path in planned.iterdir()) == ["config.json", "tokenizer.json"]


def test_a_models_revision_token_and_download_dir_reach_the_hub_fetch(tmp_path, loopback_server):
    # vLLM's revision, hf_token and download_dir, as a model's engine_args.extra gives them (ModelConfig.hub_fetch).
    from fleetserve.platform.config import parse_config

    extra = {"revision": "v1.2", "hf_token": "hf_secret", "download_dir": str(tmp_path / "volume")}
    model = parse_config({"models": [{"name": "m", "source": "acme/tiny", "engine_args": {"extra": extra}}]}).models[0]
    assert model.hub_fetch == HubFetch("v1.2", "hf_secret", str(tmp_path / "volume"))
    fetched: list[str] = []
    asked: list[tuple[str, str | None]] = []
    with loopback_server(hub_app("acme/tiny", HUB_FILES, fetched, asked)) as hub:
        folder = resolve_in_a_fresh_process(hub.url, tmp_path / "hub", hub=repr(model.hub_fetch))
    assert asked == [("v1.2", "Bearer hf_secret")]
    # In download_dir, not in the HF_HUB_CACHE the process was given.
    assert folder.is_relative_to(tmp_path / "volume") and not (tmp_path / "hub").exists()

