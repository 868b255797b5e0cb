"""LoRA adapters at the ingress, on the plain classes with a fake engine (no Ray): names, the admin API's
checks, and permissions. The engine side (vLLM's own load and unload) is tested in test_lora_served.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress import adapter_root
from fleetserve.deployments.ingress.adapter_root import RootListing
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.adapter_registry import AdapterOp
from fleetserve.platform.adapter_root import MARKER
from fleetserve.platform.config import AuthConfig, ModelConfig
from fleetserve.platform.object_store import ObjectStoreError


class RecordingClient(LocalModelClient):
    """Forwards to a fake engine; answers adapter changes as vLLM does, or with a given error."""

    def __init__(self, server: EngineServer, error: tuple[int, bytes] | None = None) -> None:
        super().__init__(server)
        self.changes: list[tuple[AdapterOp, str, str | None]] = []
        self.error = error

    async def change_adapter(self, op, name, source, load_inplace):
        if self.error is not None:
            return self.error
        self.changes.append((op, name, source))
        verb = "added" if op is AdapterOp.LOAD else "removed"
        return 200, f"Success: LoRA adapter '{name}' {verb} successfully.".encode()


def model(name: str, adapters: dict[str, str] | None = None, max_model_len: int | None = None) -> ModelConfig:
    lora = {"adapters": [{"name": a, "source": s} for a, s in adapters.items()]} if adapters is not None else None
    return ModelConfig.model_validate({"name": name, "source": "unused", "lora": lora,
                                       "engine_args": {"max_model_len": max_model_len}})


def ingress(fake_engine_cls, models: list[ModelConfig], front_door: FrontDoor | None = None,
            error: tuple[int, bytes] | None = None) -> tuple[OpenAIIngress, dict[str, RecordingClient]]:
    clients = {m.name: RecordingClient(EngineServer(m, engine_cls=fake_engine_cls, model_path="/unused"), error)
               for m in models}
    return OpenAIIngress(clients, models={m.name: m for m in models}, front_door=front_door), clients


async def call(app, path: str, body: dict | None = None, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        if body is None:
            return await http.get(path, headers=headers)
        return await http.post(path, json=body, headers=headers)


async def test_adapter_names_list_with_their_parent_and_run_on_the_base(fake_engine_cls):
    router, _ = ingress(fake_engine_cls, [model("base", {"base-sql": "random-lora:1"}, max_model_len=4096),
                                          model("other")])
    app = router.build_app()
    cards = (await call(app, "/v1/models")).json()["data"]
    assert [(card["id"], card.get("parent")) for card in cards] == [("base", None), ("other", None),
                                                                    ("base-sql", "base")]
    # The context, as `vllm serve` lists it: an adapter's is its base's; a model leaving it to vLLM lists none.
    assert [card.get("max_model_len") for card in cards] == [4096, None, 4096]
    assert (await call(app, "/v1/models/base-sql")).json()["parent"] == "base"
    response = await call(app, "/v1/completions", {"model": "base-sql", "prompt": "a b", "max_tokens": 2})
    assert response.status_code == 200
    assert response.headers["x-fleetserve-model"] == "base-sql"
    assert router.in_flight == {"base": 0, "other": 0}  # admitted and finished under its base


async def test_load_then_unload_changes_the_served_names(fake_engine_cls):
    router, clients = ingress(fake_engine_cls, [model("base", {})])
    app = router.build_app()
    loaded = await call(app, "/v1/load_lora_adapter", {"lora_name": "base-new", "lora_path": "/adapters/new"})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'base-new' added successfully.")
    assert loaded.headers["x-fleetserve-adapter-replicas"] == "0/0"  # no replica registered in this process
    assert clients["base"].changes == [(AdapterOp.LOAD, "base-new", "/adapters/new")]
    served = await call(app, "/v1/completions", {"model": "base-new", "prompt": "a", "max_tokens": 1})
    assert served.status_code == 200
    unloaded = await call(app, "/v1/unload_lora_adapter", {"lora_name": "base-new"})
    assert unloaded.status_code == 200
    gone = await call(app, "/v1/completions", {"model": "base-new", "prompt": "a", "max_tokens": 1})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    again = await call(app, "/v1/unload_lora_adapter", {"lora_name": "base-new"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "adapter_not_found"


async def test_models_lists_adapters_changed_through_another_ingress_replica(fake_engine_cls):
    from fleetserve.deployments.ingress.adapters import LocalAdapterCatalog
    from fleetserve.platform.adapter_registry import AdapterRegistry

    base = model("base", {"base-sql": "random-lora:1"})
    catalog = LocalAdapterCatalog(AdapterRegistry({"base": {"base-sql": "random-lora:1"}}), {})
    first, second = (OpenAIIngress({"base": RecordingClient(EngineServer(base, engine_cls=fake_engine_cls,
                                                                         model_path="/unused"))},
                                   models={"base": base}, adapter_catalog=catalog).build_app() for _ in range(2))
    loaded = await call(second, "/v1/load_lora_adapter", {"lora_name": "base-new", "lora_path": "/a"})
    assert loaded.status_code == 200
    assert (await call(second, "/v1/unload_lora_adapter", {"lora_name": "base-sql"})).status_code == 200
    # Before, the first replica listed its config's adapters until a request named one it did not know.
    assert [card["id"] for card in (await call(first, "/v1/models")).json()["data"]] == ["base", "base-new"]
    assert (await call(first, "/v1/models/base-sql")).status_code == 404


@pytest.mark.parametrize(("models", "body", "status", "code"), [
    # A served model's name cannot become an adapter.
    (["base", "other"], {"lora_name": "other", "lora_path": "/a"}, 400, "adapter_name_taken"),
    # Two bases take adapters: the change must say which.
    (["base", "base2"], {"lora_name": "x", "lora_path": "/a"}, 400, "base_model_required"),
    # A base without lora: cannot take one.
    (["base", "other"], {"lora_name": "x", "lora_path": "/a", "base_model": "other"}, 400, "lora_not_enabled"),
    (["base"], {"lora_name": "x"}, 400, None),
    (["base"], {"lora_name": "x", "lora_path": "/a", "rank": 8}, 400, "invalid_adapter_change"),
])
async def test_adapter_changes_refused_with_a_reason(fake_engine_cls, models, body, status, code):
    configs = [model(name, {} if name.startswith("base") else None) for name in models]
    router, clients = ingress(fake_engine_cls, configs)
    response = await call(router.build_app(), "/v1/load_lora_adapter", body)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert all(client.changes == [] for client in clients.values())  # nothing reached a replica


async def test_a_replica_refusing_the_load_leaves_the_registry_unchanged(fake_engine_cls):
    refusal = (404, b'{"error":{"message":"Loading lora x failed","type":"NotFoundError","param":null,"code":404}}')
    router, _ = ingress(fake_engine_cls, [model("base", {})], error=refusal)
    app = router.build_app()
    response = await call(app, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/missing"})
    assert (response.status_code, response.content) == refusal
    assert [card["id"] for card in (await call(app, "/v1/models")).json()["data"]] == ["base"]


async def test_adapter_permissions_and_admin_only_changes(fake_engine_cls):
    keys = {"app": "sk-app-0001", "ops": "sk-ops-0002"}
    door = FrontDoor(AuthConfig.model_validate({
        "tenants": {"app": {"models": ["base-sql"]}, "ops": {}},
        "api_keys": [{"sha256": hash_key(keys["app"]), "tenant": "app"},
                     {"sha256": hash_key(keys["ops"]), "tenant": "ops", "admin": True}]}))
    router, _ = ingress(fake_engine_cls, [model("base", {"base-sql": "random-lora:1"})], front_door=door)
    app = router.build_app()
    body = {"prompt": "a", "max_tokens": 1}
    assert (await call(app, "/v1/completions", {"model": "base-sql", **body}, keys["app"])).status_code == 200
    # The tenant may use the adapter, not its base.
    refused = await call(app, "/v1/completions", {"model": "base", **body}, keys["app"])
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "model_not_allowed")
    assert [card["id"] for card in (await call(app, "/v1/models", key=keys["app"])).json()["data"]] == ["base-sql"]
    change = {"lora_name": "base-new", "lora_path": "/a"}
    not_admin = await call(app, "/v1/load_lora_adapter", change, keys["app"])
    assert (not_admin.status_code, not_admin.json()["error"]["code"]) == (403, "admin_required")
    assert (await call(app, "/v1/load_lora_adapter", change, keys["ops"])).status_code == 200



def rooted(name: str = "base", root: str = "/roots/base") -> ModelConfig:
    return ModelConfig.model_validate({"name": name, "source": "unused", "lora": {"adapter_root": root}})


class ForwardRecordingClient(LocalModelClient):
    """Records each request's model and adapter hint, then runs it on a fake engine."""

    def __init__(self, server: EngineServer) -> None:
        super().__init__(server)
        self.forwarded: list[tuple[str, str | None]] = []

    def forward(self, request):
        self.forwarded.append((json.loads(request.body)["model"], request.routing.adapter))
        return super().forward(request)


def rooted_ingress(fake_engine_cls, front_door: FrontDoor | None = None, root: str = "/roots/base"):
    """An ingress whose base has an adapter root, over a fake engine (which loads nothing: the replica's loads are
    tested in test_replica_adapters.py and test_lora_served.py)."""
    config, plain = rooted(root=root), ModelConfig.model_validate({"name": "plain", "source": "unused"})
    clients = {m.name: ForwardRecordingClient(EngineServer(ModelConfig(name=m.name, source="unused"),
                                                           engine_cls=fake_engine_cls, model_path="/unused"))
               for m in (config, plain)}
    return OpenAIIngress(clients, models={"base": config, "plain": plain}, front_door=front_door), clients


async def test_a_name_under_an_adapter_root_runs_on_its_base_as_that_adapter(fake_engine_cls):
    router, clients = rooted_ingress(fake_engine_cls)
    app = router.build_app()
    response = await call(app, "/v1/completions", {"model": "base:sql", "prompt": "a b", "max_tokens": 2})
    assert (response.status_code, response.headers["x-fleetserve-model"]) == (200, "base:sql")
    # The body keeps the name (the replica loads the adapter it names); the router prefers replicas holding it.
    assert clients["base"].forwarded == [("base:sql", "base:sql")]
    assert router.in_flight == {"base": 0, "plain": 0}  # admitted and finished under its base


@pytest.mark.parametrize(("name", "status", "code"), [
    ("base:..", 400, "invalid_adapter_name"),       # a path out of the root
    ("base:.cache", 400, "invalid_adapter_name"),
    ("base:a/b", 400, "invalid_adapter_name"),
    ("plain:sql", 404, "model_not_found"),          # a model without an adapter root
    ("nobody:sql", 404, "model_not_found"),
])
async def test_a_name_that_is_no_folder_under_a_root_is_refused_at_the_ingress(fake_engine_cls, name, status, code):
    router, clients = rooted_ingress(fake_engine_cls)
    response = await call(router.build_app(), "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1})
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert all(client.forwarded == [] for client in clients.values())


async def test_the_admin_api_refuses_names_that_adapter_roots_take(fake_engine_cls):
    router, _ = ingress(fake_engine_cls, [model("base", {})])
    response = await call(router.build_app(), "/v1/load_lora_adapter", {"lora_name": "base:x", "lora_path": "/a"})
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_adapter_name")


async def test_a_tenant_uses_the_roots_adapters_of_a_base_it_may_use_and_no_other(fake_engine_cls):
    keys = {"app": "sk-app-0001", "other": "sk-oth-0002"}
    door = FrontDoor(AuthConfig.model_validate({
        "tenants": {"app": {"models": ["base"]}, "other": {"models": ["plain"]}},
        "api_keys": [{"sha256": hash_key(keys["app"]), "tenant": "app"},
                     {"sha256": hash_key(keys["other"]), "tenant": "other"}]}))
    router, clients = rooted_ingress(fake_engine_cls, front_door=door)
    app = router.build_app()
    body = {"model": "base:sql", "prompt": "a", "max_tokens": 1}
    refused = await call(app, "/v1/completions", body, keys["other"])
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "model_not_allowed")
    assert clients["base"].forwarded == []  # refused before a replica could load anything
    assert (await call(app, "/v1/completions", body, keys["app"])).status_code == 200


def adapter_folders(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / MARKER).write_text("{}")
    return root


async def test_the_adapters_of_a_root_list_with_their_base_as_parent(fake_engine_cls, tmp_path):
    root = adapter_folders(tmp_path / "root", "sql", "chat", ".hidden")
    (root / "notes").mkdir()  # no adapter config: not an adapter
    router, _ = rooted_ingress(fake_engine_cls, root=str(root))
    app = router.build_app()
    cards = (await call(app, "/v1/models")).json()["data"]
    assert [(card["id"], card.get("parent")) for card in cards] == [
        ("base", None), ("plain", None), ("base:chat", "base"), ("base:sql", "base")]
    assert (await call(app, "/v1/models/base:sql")).json()["parent"] == "base"


async def test_a_tenant_lists_the_roots_adapters_of_the_bases_it_may_use_only(fake_engine_cls, tmp_path):
    keys = {"app": "sk-app-0001", "other": "sk-oth-0002"}
    door = FrontDoor(AuthConfig.model_validate({
        "tenants": {"app": {"models": ["base"]}, "other": {"models": ["plain"]}},
        "api_keys": [{"sha256": hash_key(keys["app"]), "tenant": "app"},
                     {"sha256": hash_key(keys["other"]), "tenant": "other"}]}))
    router, _ = rooted_ingress(fake_engine_cls, door, root=str(adapter_folders(tmp_path / "root", "sql")))
    app = router.build_app()
    assert [card["id"] for card in (await call(app, "/v1/models", key=keys["app"])).json()["data"]] == [
        "base", "base:sql"]
    assert [card["id"] for card in (await call(app, "/v1/models", key=keys["other"])).json()["data"]] == ["plain"]
    assert (await call(app, "/v1/models/base:sql", key=keys["other"])).status_code == 404


async def test_an_adapter_added_to_a_root_since_its_listing_is_found_by_id_then_listed(fake_engine_cls, tmp_path):
    root = adapter_folders(tmp_path / "root", "sql")
    router, _ = rooted_ingress(fake_engine_cls, root=str(root))
    app = router.build_app()
    assert [card["id"] for card in (await call(app, "/v1/models")).json()["data"]][-1] == "base:sql"
    adapter_folders(root, "chat")  # within the listing's 30 s: not listed yet, but served on its first request
    card = (await call(app, "/v1/models/base:chat")).json()
    assert (card["id"], card["parent"]) == ("base:chat", "base")
    assert [card["id"] for card in (await call(app, "/v1/models")).json()["data"]][-2:] == ["base:chat", "base:sql"]
    # A folder without an adapter config, one that is not there, a name that is no folder: none is a model.
    (root / "notes").mkdir()
    for name in ("base:notes", "base:none", "base:..", "plain:sql"):
        missing = await call(app, f"/v1/models/{name}")
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found"), name


async def test_a_root_is_listed_again_only_once_its_listing_is_older_than_the_ttl(tmp_path):
    root = adapter_folders(tmp_path / "root", "a")
    now = [0.0]
    listing = RootListing({"base": rooted(root=str(root))}, ttl_s=30.0, clock=lambda: now[0])
    assert await listing.refresh() == {"base:a": "base"}
    adapter_folders(root, "b")
    now[0] = 29.9
    assert await listing.refresh() == {"base:a": "base"}  # the listing of t=0 serves until t=30
    now[0] = 30.0
    assert await listing.refresh() == {"base:a": "base", "base:b": "base"}


async def test_a_root_that_cannot_be_listed_keeps_its_last_listing(tmp_path, monkeypatch):
    root = adapter_folders(tmp_path / "root", "a")
    now = [0.0]
    listing = RootListing({"base": rooted(root=str(root)), "other": rooted("other", str(tmp_path / "none"))},
                          ttl_s=1.0, clock=lambda: now[0])
    assert await listing.refresh() == {"base:a": "base"}  # a local root missing on this node lists nothing

    def unreadable(root: str) -> list[str]:
        raise ObjectStoreError(f"could not list {root}: AccessDenied")

    monkeypatch.setattr(adapter_root, "list_folders", unreadable)
    now[0] = 1.0
    assert await listing.refresh() == {"base:a": "base"}
