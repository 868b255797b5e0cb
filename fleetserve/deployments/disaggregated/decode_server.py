"""The decode server: fetches a prompt's KV from the prefill pool, then generates and streams.

The decode replica orchestrates its own request (as llm-d's decode-side sidecar does): it tokenizes,
skips remote prefill for short prompts, asks the prefill pool for the KV (retrying on failure), and
pulls the KV during its first step. Any prefill replica may serve any decode replica (xPyD).

``DecodeServer`` is a plain class with an injected prefill client; ``DecodeDeployment`` is its Ray
Serve subclass, whose client is the prefill deployment's handle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from ray import serve

from fleetserve.deployments.disaggregated.prefill_server import KVTransferReplica, PrefillResult, PrefillServer
from fleetserve.deployments.engine_server import EngineChunk, EngineRequest, EngineServer
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import EngineRequestError
from fleetserve.platform.kv_transfer import KVTransferSpec

logger = logging.getLogger(__name__)


class PrefillClient(Protocol):
    """How a decode server reaches the prefill pool."""

    async def prefill(self, request: EngineRequest) -> PrefillResult: ...


class LocalPrefillClient:
    """In-process prefill servers (tests, single-process use), chosen by fewest prefills in flight.

    Args:
        servers: the prefill pool.
        order: replica indices to use in turn instead of by load (tests pin a pairing with it).
    """

    def __init__(self, servers: Sequence[PrefillServer], order: Sequence[int] | None = None) -> None:
        self.servers = list(servers)
        self.in_flight = [0] * len(self.servers)
        self._order = list(order) if order is not None else None
        self._turn = 0

    def _pick(self) -> int:
        if self._order is not None:
            index = self._order[self._turn % len(self._order)]
            self._turn += 1
            return index
        return min(range(len(self.servers)), key=lambda i: self.in_flight[i])

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        index = self._pick()
        self.in_flight[index] += 1
        try:
            return await self.servers[index].prefill(request)
        finally:
            self.in_flight[index] -= 1


class HandlePrefillClient:
    """The prefill deployment through its Serve handle; the pool's request router picks the replica."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        response = self.handle.prefill.remote(request)
        try:
            return await response
        except asyncio.CancelledError:
            # The client left during prefill: stop the prefill too, so its KV is not held for nobody.
            response.cancel()
            raise


def _unavailable(message: str) -> EngineRequestError:
    return EngineRequestError(message, status_code=503, error_type="service_unavailable")


class DecodeServer(EngineServer):
    """Serves the decode phase of one model, fetching each prompt's KV from the prefill pool.

    Args:
        model: the decode pool's config (``ModelConfig.pool_model("decode")``).
        prefill_client: reaches the prefill pool.
        kv_transfer: the engine's KV connector and handshake address.
        **kwargs: as for ``EngineServer``.
    """

    def __init__(self, model: ModelConfig, *, prefill_client: PrefillClient, kv_transfer: KVTransferSpec,
                 **kwargs: Any) -> None:
        super().__init__(model, kv_transfer=kv_transfer, **kwargs)
        self.prefill_client = prefill_client
        self.settings = model.disaggregation

    async def _remote_prefill(self, request: EngineRequest, prompt_ids: list[int]) -> PrefillResult:
        """The prefill pool's KV for ``prompt_ids``, tried up to max_prefill_attempts times.

        Raises:
            EngineRequestError: the request is invalid (400, not retried), or every attempt failed (503).
        """
        errors: list[str] = []
        for attempt in range(1, self.settings.max_prefill_attempts + 1):
            # Each attempt is a new engine request: a half-finished one may still be running elsewhere.
            attempt_request = dataclasses.replace(request, request_id=f"{request.request_id}-p{attempt}",
                                                  prompt=prompt_ids, messages=None)
            try:
                return await asyncio.wait_for(self.prefill_client.prefill(attempt_request),
                                              self.settings.prefill_timeout_s)
            except EngineRequestError as error:
                if error.status_code < 500:
                    raise
                errors.append(error.message)
            except TimeoutError:
                errors.append(f"no answer within prefill_timeout_s={self.settings.prefill_timeout_s:g}")
            except Exception as error:  # noqa: BLE001 - a dead or failing prefill replica: try another
                cause = getattr(error, "cause", None)
                if isinstance(cause, EngineRequestError) and cause.status_code < 500:
                    raise cause from None
                errors.append(f"{type(error).__name__}: {error}"[:300])
            logger.warning("prefill attempt %d/%d for %s failed: %s", attempt,
                           self.settings.max_prefill_attempts, request.request_id, errors[-1])
        raise _unavailable(f"prefill failed on {len(errors)} attempt(s); retry shortly. Last error: {errors[-1]}")

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Streams the request's output; prompts of at least min_prompt_tokens are prefilled remotely.

        Raises:
            EngineRequestError: the prompt or options are invalid (400), or the prefill pool failed (503).
        """
        started_at = time.time()
        prompt_ids = self._prompt_ids(request)
        self.engine.check_length(len(prompt_ids), request.options.max_tokens)
        prefill: PrefillResult | None = None
        if len(prompt_ids) >= max(1, self.settings.min_prompt_tokens):
            prefill = await self._remote_prefill(request, prompt_ids)
            prompt_ids = prefill.prompt_token_ids
        params = prefill.kv_transfer_params if prefill is not None else None
        prefill_replica = prefill.replica_id if prefill is not None else None
        # What is left to compute here: the whole prompt, or none of it when its KV came from a prefill replica.
        local_tokens = 0 if prefill is not None else len(prompt_ids)
        async for delta in self._until_first_output(local_tokens, self.engine.generate(
                prompt_ids, request.options, request.request_id, params)):
            yield EngineChunk(self.replica_id, delta, started_at, prefill_replica)


@serve.deployment
class DecodeDeployment(KVTransferReplica, DecodeServer):
    """Ray Serve replica of a decode server; the ingress reaches it as the model's engine deployment."""

    def __init__(self, model: dict[str, Any], cpu_bindings: list[str] | None = None,
                 model_path: str | None = None, metrics_hub: Any = None, prefill: Any = None) -> None:
        config = ModelConfig.model_validate(model).pool_model("decode")
        replica_id, binding = self._replica_identity(config, cpu_bindings)
        super().__init__(config, prefill_client=HandlePrefillClient(prefill), kv_transfer=self._kv_transfer(config),
                         replica_id=replica_id, cpu_binding=binding, model_path=model_path)
        self._start_publishing(metrics_hub)
