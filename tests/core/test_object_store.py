"""Model and adapter sources in object storage, fetched from an S3 API served by moto on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.platform.adapter_root import holds_adapter, list_folders
from fleetserve.platform.lora_store import AdapterSourceError, build_random_lora, resolve_adapter_source
from fleetserve.platform.model_store import (
    ModelSourceError,
    SourceKind,
    resolve_source,
    source_kind,
    tiny_random_llama,
)

pytest.importorskip("moto", reason="the S3 tests serve S3 with moto (the dev extra)")
pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    from fleetserve.platform.ports import free_port

    port = free_port("127.0.0.1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch, tmp_path):
    """A boto3 client on the moto endpoint, with the environment every S3 client here reads."""
    import boto3
    import s3fs

    for key, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1", "FLEETSERVE_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3")
    for bucket in ("models", "adapters", "routers"):
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
    return client


def upload(client, folder: Path, bucket: str, prefix: str) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


def test_an_object_store_uri_is_its_own_kind_of_source():
    assert source_kind("s3://models/tiny") is SourceKind.OBJECT_STORE
    assert source_kind("gs://models/tiny") is SourceKind.OBJECT_STORE
    assert source_kind("s3://") is SourceKind.PATH  # no bucket: a (missing) path, refused as not found


def test_a_model_folder_in_s3_is_fetched_with_its_serving_files_only(s3):
    tiny = tiny_random_llama()
    upload(s3, tiny, "models", "tiny")
    s3.put_object(Bucket="models", Key="tiny/optimizer.pt", Body=b"not for serving")
    folder = resolve_source("s3://models/tiny")
    serving = sorted(path.name for path in tiny.iterdir())
    assert sorted(path.name for path in folder.iterdir()) == serving  # the tiny model's files, not optimizer.pt
    for name in serving:
        assert (folder / name).read_bytes() == (tiny / name).read_bytes()


def test_an_unchanged_folder_is_fetched_once_and_a_replaced_one_again(s3):
    upload(s3, tiny_random_llama(), "models", "again")
    first = resolve_source("s3://models/again")
    (first / "marker").write_text("kept")  # a second fetch would build a new folder without it
    assert resolve_source("s3://models/again/") == first
    assert (first / "marker").read_text() == "kept"
    config = json.loads((first / "config.json").read_text())
    s3.put_object(Bucket="models", Key="again/config.json", Body=json.dumps({**config, "rms_norm_eps": 1e-5}))
    second = resolve_source("s3://models/again")
    assert second != first
    assert json.loads((second / "config.json").read_text())["rms_norm_eps"] == 1e-5


def test_the_planner_fetches_only_the_json_files(s3):
    upload(s3, tiny_random_llama(), "models", "plan")
    folder = resolve_source("s3://models/plan", config_only=True)
    assert sorted(path.suffix for path in folder.iterdir()) == [".json"] * len(list(folder.iterdir()))
    assert (folder / "config.json").exists() and not (folder / "model.safetensors").exists()


def test_a_prefix_with_no_model_is_refused_naming_it(s3):
    with pytest.raises(ModelSourceError, match=r"^model source s3://models/nothing-here holds no config\.json "
                                               r"\(nothing at that prefix\); expected a Hugging Face model folder$"):
        resolve_source("s3://models/nothing-here")


def test_a_store_without_its_package_is_refused_naming_the_package():
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ModelSourceError, match=r"needs the gcsfs package \(pip install gcsfs\)"):
        resolve_source("gs://models/tiny")


def test_an_adapter_folder_in_s3_is_fetched_and_checked_like_a_local_one(s3, tmp_path):
    tiny = tiny_random_llama()
    local = tmp_path / "adapter"
    build_random_lora(tiny, local, seed=3, rank=4)
    upload(s3, local, "adapters", "a3")
    folder = resolve_adapter_source("s3://adapters/a3", tiny, max_lora_rank=8)
    assert (folder / "adapter_model.safetensors").read_bytes() == (local / "adapter_model.safetensors").read_bytes()
    # vLLM's own check of the fetched folder: rank 4 is above a max_lora_rank of 2.
    with pytest.raises(AdapterSourceError, match="rank") as refused:
        resolve_adapter_source("s3://adapters/a3", tiny, max_lora_rank=2)
    assert refused.value.status_code == 400


def test_an_adapter_root_in_s3_lists_its_adapter_folders(s3):
    for key in ("root/sql/adapter_config.json", "root/chat/adapter_config.json", "root/notes/readme.md",
                "root/.hidden/adapter_config.json", "root/deep/er/adapter_config.json"):
        s3.put_object(Bucket="adapters", Key=key, Body=b"{}")
    # notes holds no adapter config, .hidden is no name a request can give, deep/er is two levels down.
    assert list_folders("s3://adapters/root") == ["chat", "sql"]
    s3.put_object(Bucket="adapters", Key="root/new/adapter_config.json", Body=b"{}")
    assert list_folders("s3://adapters/root/") == ["chat", "new", "sql"]  # listed afresh, not from fsspec's cache
    assert list_folders("s3://adapters/none") == []
    # One folder checked alone (GET /v1/models/{id} of an adapter added since the last listing), afresh too.
    assert not holds_adapter("s3://adapters/root", "later") and not holds_adapter("s3://adapters/root", "notes")
    s3.put_object(Bucket="adapters", Key="root/later/adapter_config.json", Body=b"{}")
    assert holds_adapter("s3://adapters/root", "later")


def test_a_missing_adapter_in_s3_is_a_404(s3):
    with pytest.raises(AdapterSourceError, match=r"s3://adapters/none holds no adapter_config\.json") as missing:
        resolve_adapter_source("s3://adapters/none", tiny_random_llama(), max_lora_rank=8)
    assert missing.value.status_code == 404


def test_a_router_checkpoint_in_s3_serves_a_route_as_the_local_one_does(s3, tmp_path):
    import yaml

    from factories import HARD_PROMPT, calibrated_classifier
    from fleetserve.platform.config import load_config
    from fleetserve.platform.config.paths import config_paths
    from fleetserve.router.model.routes import RouteTable

    local = calibrated_classifier().save(tmp_path / "classifier")
    upload(s3, local, "routers", "classifier")
    config_file = tmp_path / "routed.yaml"
    config_file.write_text(yaml.safe_dump({
        "models": [{"name": "weak", "source": "tiny-random-llama"}, {"name": "strong", "source": "tiny-random-llama"}],
        "model_routing": {"checkpoints": {"classifier": "s3://routers/classifier"}, "tiers": ["weak", "strong"],
                          "routes": [{"name": "auto", "router": "classifier", "strong_fraction": 0.25}]}}))
    config = load_config(config_file)
    assert config.model_routing.checkpoints == {"classifier": "s3://routers/classifier"}  # not made a local path
    assert config_paths(config) == []  # nothing a pod must mount
    table = RouteTable(config.model_routing)
    # The synthetic data's hard prompt goes to the strong tier, as the checkpoint it was saved from sends it.
    assert table.choose(table.resolve("auto"), HARD_PROMPT).model == "strong"
    fetched, saved = table.routers["classifier"], calibrated_classifier()
    assert fetched.metadata["calibrations"] == saved.metadata["calibrations"]
    assert all((fetched.weights[name] == saved.weights[name]).all() for name in saved.weights)


def test_a_missing_router_checkpoint_in_s3_is_refused_naming_it(s3):
    from fleetserve.router.model.quality_router import CheckpointError, load_router

    with pytest.raises(CheckpointError, match=r"^router checkpoint s3://routers/none holds no metadata\.json"):
        load_router("s3://routers/none")
