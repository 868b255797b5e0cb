"""LoRA adapters at the ingress, on the plain classes with a fake engine (no Ray): names, the admin API's
checks, and permissions. The engine side (vLLM's own load and unload) is tested in test_lora_served.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.adapter_registry import AdapterOp
from fleetserve.platform.config import AuthConfig, ModelConfig


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


class SlowClient(RecordingClient):
    """Takes a while to load, as a replica fetching an adapter does."""

    async def change_adapter(self, op, name, source, load_inplace):
        await asyncio.sleep(0.05)
        assert load_inplace  # another ingress replica may be loading it too
        return await super().change_adapter(op, name, source, load_inplace)


async def test_an_adapter_under_the_root_loads_once_on_its_first_requests(fake_engine_cls):
    config = rooted()
    client = SlowClient(EngineServer(config, engine_cls=fake_engine_cls, model_path="/unused"))
    router = OpenAIIngress({"base": client}, models={"base": config})
    app = router.build_app()
    body = {"model": "base:sql", "prompt": "a b", "max_tokens": 2}
    first = await asyncio.gather(*(call(app, "/v1/completions", body) for _ in range(3)))
    assert [response.status_code for response in first] == [200, 200, 200]
    assert first[0].headers["x-fleetserve-model"] == "base:sql"
    assert (await call(app, "/v1/completions", body)).status_code == 200
    # Three requests while it loaded, one after: one load, from the root's subfolder.
    assert client.changes == [(AdapterOp.LOAD, "base:sql", "/roots/base/sql")]
    cards = (await call(app, "/v1/models")).json()["data"]
    assert [(card["id"], card.get("parent")) for card in cards] == [("base", None), ("base:sql", "base")]


@pytest.mark.parametrize(("name", "status", "code"), [
    ("base:..", 400, "invalid_adapter_name"),       # a path out of the root
    ("base:.cache", 400, "invalid_adapter_name"),
    ("base:a/b", 400, "invalid_adapter_name"),
    ("other:sql", 404, "model_not_found"),          # a model without an adapter root
    ("nobody:sql", 404, "model_not_found"),
])
async def test_a_name_that_is_no_adapter_under_a_root_is_refused_without_a_load(fake_engine_cls, name, status, code):
    router, clients = ingress(fake_engine_cls, [rooted(), model("other", {})])
    response = await call(router.build_app(), "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1})
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert all(client.changes == [] for client in clients.values())


async def test_an_adapter_missing_from_the_root_is_a_404_naming_it(fake_engine_cls):
    missing = (404, b'{"error":{"message":"lora_path s3://b/base/nope: no such adapter","type":"NotFoundError",'
                    b'"param":"lora_path","code":404}}')
    router, _ = ingress(fake_engine_cls, [rooted(root="s3://b/base/")], error=missing)
    app = router.build_app()
    response = await call(app, "/v1/completions", {"model": "base:nope", "prompt": "a", "max_tokens": 1})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `base:nope` does not exist: lora_path s3://b/base/nope: no such adapter",
        "type": "not_found_error", "param": "model", "code": "model_not_found"}
    assert [card["id"] for card in (await call(app, "/v1/models")).json()["data"]] == ["base"]


async def test_a_tenant_uses_the_roots_adapters_of_a_base_it_may_use_and_loads_no_other(fake_engine_cls):
    keys = {"app": "sk-app-0001", "other": "sk-oth-0002"}
    door = FrontDoor(AuthConfig.model_validate({
        "tenants": {"app": {"models": ["base"]}, "other": {"models": ["plain"]}},
        "api_keys": [{"sha256": hash_key(keys["app"]), "tenant": "app"},
                     {"sha256": hash_key(keys["other"]), "tenant": "other"}]}))
    router, clients = ingress(fake_engine_cls, [rooted(), model("plain")], front_door=door)
    app = router.build_app()
    body = {"model": "base:sql", "prompt": "a", "max_tokens": 1}
    refused = await call(app, "/v1/completions", body, keys["other"])
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "model_not_allowed")
    assert clients["base"].changes == []  # refused before any load
    assert (await call(app, "/v1/completions", body, keys["app"])).status_code == 200
    assert [card["id"] for card in (await call(app, "/v1/models", key=keys["app"])).json()["data"]] == [
        "base", "base:sql"]
    assert (await call(app, "/v1/completions", body, keys["other"])).status_code == 403
