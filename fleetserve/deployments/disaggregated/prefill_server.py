"""The prefill server: computes a prompt's KV and keeps it for a decode engine to pull.

``PrefillServer`` is a plain class; ``PrefillDeployment`` is its Ray Serve subclass.
"""

from __future__ import annotations

import json
import logging
import os
import time
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


# The endpoints whose requests vLLM can prefill on one engine and decode on another: each takes
# ``kv_transfer_params`` in its body and returns the handover in its response.
DISAGGREGATED_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.MESSAGES, Endpoint.RESPONSES})
# The field that bounds each endpoint's output, set to one token for the prefill.
_OUTPUT_BUDGET = {Endpoint.CHAT: "max_completion_tokens", Endpoint.COMPLETIONS: "max_tokens",
                  Endpoint.MESSAGES: "max_tokens", Endpoint.RESPONSES: "max_output_tokens"}


def prefill_body(payload: dict[str, Any], endpoint: Endpoint) -> bytes:
    """The client's request as a prefill: one token, not streamed, with its KV kept for a decode engine.

    Only fields the endpoint's vLLM request type has are set: a chat or completion request samples once
    (``n``) with no minimum; a Responses request is not stored or run in the background, since its answer
    is the decode replica's to keep.
    """
    body = {**payload, "stream": False, "kv_transfer_params": REMOTE_DECODE}
    body.pop("stream_options", None)
    if endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        body.update(n=1, min_tokens=0)
    if endpoint is Endpoint.CHAT:
        body.pop("max_tokens", None)
    if endpoint is Endpoint.RESPONSES:
        body.update(store=False, background=False)
    # One token: vLLM's prefill step samples one, which the decode engine recomputes and keeps.
    body[_OUTPUT_BUDGET[endpoint]] = 1
    return json.dumps(body).encode()


def cached_prompt_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens found in the prefix cache, from any endpoint's usage: OpenAI's chat and completions
    (``prompt_tokens_details``), Responses (``input_tokens_details``) or Anthropic (``cache_read_input_tokens``)."""
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key) or {}
        if details.get("cached_tokens"):
            return int(details["cached_tokens"])
    return int(usage.get("cache_read_input_tokens") or 0)


class PrefillServer(EngineServer):
    """Serves the prefill phase of one model.

    Args:
        model: the prefill pool's config (``ModelConfig.pool_model("prefill")``).
        kv_transfer: the engine's KV connector and handshake address.
        **kwargs: as for ``EngineServer``.
    """

    def __init__(self, model: ModelConfig, *, kv_transfer: KVTransferSpec, **kwargs: Any) -> None:
        super().__init__(model, kv_transfer=kv_transfer, **kwargs)

    async def wake(self) -> None:
        """Nothing: a decode replica calls it to start this pool from zero (Serve queues the call until a
        replica runs, and a call queued for a deployment at zero starts one)."""

    async def prefill(self, request: ApiRequest) -> PrefillResult:
        """Computes the prompt's KV and keeps it for a decode engine.

        Args:
            request: a body built by ``prefill_body``.

        Raises:
            PrefillError: vLLM failed the request (5xx) or returned no KV transfer parameters.
        """
        refusal = await self._root_adapter_refusal(json.loads(request.body), time.time())
        if refusal is not None:  # the adapter-root adapter it names cannot load here
            return PrefillResult(self.replica_id, error_status=refusal.head.status_code, error_body=refusal.data)
        head, body = await self.respond(request)
        if 400 <= head.status_code < 500:
            return PrefillResult(self.replica_id, error_status=head.status_code, error_body=body)
        if head.status_code != 200:
            raise PrefillError(f"prefill replica {self.replica_id} answered {head.status_code}: {body[:300]!r}")
        payload = json.loads(body)
        params = payload.get("kv_transfer_params")
        if not params:
            raise PrefillError(f"prefill replica {self.replica_id} returned no KV transfer parameters")
        return PrefillResult(self.replica_id, params, cached_prompt_tokens(payload.get("usage") or {}))


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

    async def __init__(self, model: ModelConfig, cpu_bindings: list[str] | None = None,  # type: ignore[misc]
                       model_path: str | None = None, metrics_hub: Any = None,
                       engine_cls: type[Engine] = Engine) -> None:
        config = model.pool_model("prefill")
        replica_id, binding = self._replica_identity(config, cpu_bindings)
        super().__init__(config, kv_transfer=self._kv_transfer(config), replica_id=replica_id,
                         cpu_binding=binding, model_path=model_path, engine_cls=engine_cls,
                         kv_events_port=self._kv_events_port(config))
        await self._start_replica_tasks(metrics_hub)
