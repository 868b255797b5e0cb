"""An ingress with two tenants (heavy and light) over a fake engine whose first token is slow, so every sent
request holds its engine slot while the rest arrive."""

from __future__ import annotations

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.security import FrontDoor, hash_key
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.config import AuthConfig, LimitsConfig, ModelConfig
from fleetserve.platform.replica_report import ReplicaReport

KEYS = {"heavy": "sk-heavy-0001", "light": "sk-light-0002"}


def tenant_ingress(engine_cls, tenants: dict, max_num_seqs: int = 1, first_token_s: float = 2.0,
                   scheduling_policy: str | None = None, **limits) -> tuple[OpenAIIngress, EngineServer]:
    """The ingress over one reporting, idle replica of model ``fake``; ``limits`` override a queue of 8 with
    shares from half of it (min_queued_per_replica 8, fair_share_from 0.5).

    Args:
        tenants: ``auth.tenants``, keyed by the names in ``KEYS``.
    """
    class SlowStart(engine_cls):
        pass

    SlowStart.first_token_s = first_token_s
    extra = {"scheduling_policy": scheduling_policy} if scheduling_policy else {}
    model = ModelConfig(name="fake", source="unused", engine_args={"max_num_seqs": max_num_seqs, "extra": extra})
    server = EngineServer(model, engine_cls=SlowStart, model_path="/unused")
    auth = AuthConfig.model_validate({
        "tenants": tenants, "api_keys": [{"sha256": hash_key(key), "tenant": name} for name, key in KEYS.items()]})
    app = OpenAIIngress({"fake": LocalModelClient(server)}, models={"fake": model}, front_door=FrontDoor(auth),
                        limits=LimitsConfig(**{"min_queued_per_replica": 8, "fair_share_from": 0.5, **limits}))
    app.work.admission["fake"].observe([ReplicaReport(replica_id="r0")])
    return app, server
