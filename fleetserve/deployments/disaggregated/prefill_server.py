"""The prefill server: computes a prompt's KV and keeps it for a decode engine to pull.

``PrefillServer`` is a plain class; ``PrefillDeployment`` is its Ray Serve subclass.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ray import serve

from fleetserve.deployments.engine_server import EngineServer, ServeReplica
from fleetserve.platform.engine import Engine
from fleetserve.platform.api_types import ApiRequest, Endpoint
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.kv_transfer import KVTransferSpec, lease_side_channel_ports, release_side_channel_ports

logger = logging.getLogger(__name__)
# Asks the engine to hold the finished prompt's KV blocks for a remote decode.
REMOTE_DECODE = {"do_remote_decode": True}


class PrefillError(RuntimeError):
    """A prefill that produced no KV to hand over (the engine has no connector, or returned nothing)."""


@dataclass(frozen=True)
class PrefillResult:
    """What a decode engine needs to continue a request a prefill engine started, or why it cannot."""

    # The prefill replica that holds the KV.
    replica_id: str
    # vLLM's handover: remote block ids, engine id and handshake address, for the decode engine.
    kv_transfer_params: dict[str, Any] | None = None
    # Prompt tokens the prefill engine found in its own prefix cache.
    num_cached_tokens: int = 0
    # A request vLLM refused (a 4xx): its status and vLLM's error body, for the client as they are.
    error_status: int | None = None
    error_body: bytes = b""


def prefill_body(payload: dict[str, Any], endpoint: Endpoint) -> bytes:
    """The client's request as a prefill: one token, not streamed, with its KV kept for a decode engine."""
    body = {**payload, "stream": False, "n": 1, "min_tokens": 0, "kv_transfer_params": REMOTE_DECODE}
    body.pop("stream_options", None)
    # One token: vLLM's prefill step samples one, which the decode engine recomputes and keeps.
    if endpoint is Endpoint.CHAT:
        body.pop("max_tokens", None)
        body["max_completion_tokens"] = 1
    else:
        body["max_tokens"] = 1
    return json.dumps(body).encode()


class PrefillServer(EngineServer):
    """Serves the prefill phase of one model.

    Args:
        model: the prefill pool's config (``ModelConfig.pool_model("prefill")``).
        kv_transfer: the engine's KV connector and handshake address.
        **kwargs: as for ``EngineServer``.
    """

    def __init__(self, model: ModelConfig, *, kv_transfer: KVTransferSpec, **kwargs: Any) -> None:
        super().__init__(model, kv_transfer=kv_transfer, **kwargs)

    async def prefill(self, request: ApiRequest) -> PrefillResult:
        """Computes the prompt's KV and keeps it for a decode engine.

        Args:
            request: a body built by ``prefill_body``.

        Raises:
            PrefillError: vLLM failed the request (5xx) or returned no KV transfer parameters.
        """
        head, body = await self.respond(request)
        if 400 <= head.status_code < 500:
            return PrefillResult(self.replica_id, error_status=head.status_code, error_body=body)
        if head.status_code != 200:
            raise PrefillError(f"prefill replica {self.replica_id} answered {head.status_code}: {body[:300]!r}")
        payload = json.loads(body)
        params = payload.get("kv_transfer_params")
        if not params:
            raise PrefillError(f"prefill replica {self.replica_id} returned no KV transfer parameters")
        details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
        return PrefillResult(self.replica_id, params, int(details.get("cached_tokens") or 0))


def replica_kv_transfer(model: ModelConfig, host: str) -> KVTransferSpec:
    """Leases this replica's handshake port(s) on the node and describes its connector."""
    pd = model.disaggregation
    num_ports = int(model.engine_args.extra.get("data_parallel_size", 1))
    port = lease_side_channel_ports(num_ports, host=host)
    return KVTransferSpec(connector=pd.connector, side_channel_host=host, side_channel_port=port,
                          lease_s=pd.kv_lease_s, progress_delay_us=pd.nixl_progress_delay_us)


class KVTransferReplica(ServeReplica):
    """A Serve replica whose engine joins KV transfer: leases its port and returns it on shutdown."""

    def _kv_transfer(self, config: ModelConfig) -> KVTransferSpec:
        from ray.util import get_node_ip_address

        # Peers on other nodes reach the handshake at this node's address; loopback when single-node.
        host = os.environ.get("FLEETSERVE_SIDE_CHANNEL_HOST") or get_node_ip_address()
        self._kv_spec = replica_kv_transfer(config, host)
        return self._kv_spec

    def __del__(self) -> None:
        super().__del__()
        spec = getattr(self, "_kv_spec", None)
        if spec is not None:
            release_side_channel_ports(spec.side_channel_port)


@serve.deployment
class PrefillDeployment(KVTransferReplica, PrefillServer):
    """Ray Serve replica of a prefill server; options from ``serve_options.deployment_options`` of its pool."""

    def __init__(self, model: ModelConfig, cpu_bindings: list[str] | None = None,
                 model_path: str | None = None, metrics_hub: Any = None, engine_cls: type[Engine] = Engine) -> None:
        config = model.pool_model("prefill")
        replica_id, binding = self._replica_identity(config, cpu_bindings)
        super().__init__(config, kv_transfer=self._kv_transfer(config), replica_id=replica_id,
                         cpu_binding=binding, model_path=model_path, engine_cls=engine_cls)
        self._start_replica_tasks(metrics_hub)
