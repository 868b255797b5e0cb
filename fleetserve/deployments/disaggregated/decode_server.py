"""The decode server: fetches a prompt's KV from the prefill pool, then generates and streams.

The decode replica orchestrates its own request (as llm-d's decode-side sidecar does): it skips remote
prefill for short prompts, asks the prefill pool for the KV (retrying on failure), and pulls the KV during
its first step. Both phases run the client's own body through vLLM's OpenAI app, so the prompt is rendered
the same way on both sides; the handover is vLLM's ``kv_transfer_params``, as in vLLM's own disaggregation
proxy. Any prefill replica may serve any decode replica (xPyD).

``DecodeServer`` is a plain class with an injected prefill client; ``DecodeDeployment`` is its Ray
Serve subclass, whose client is the prefill deployment's handle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from ray import serve

from fleetserve.deployments.disaggregated.prefill_server import (
    DISAGGREGATED_ENDPOINTS,
    KVTransferReplica,
    PrefillResult,
    PrefillServer,
    prefill_body,
)
from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.deployments.ingress.request_fields import read_fields
from fleetserve.deployments.serve_options import HEALTH_CHECK_PERIOD_S, data_path_handle_options
from fleetserve.platform.api_types import ApiRequest, Endpoint, ReplicaChunk, ResponseHead, RoutingHints
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import Engine, EngineDeadError, EngineRequestError, dead_replica_id
from fleetserve.platform.kv_transfer import KVTransferSpec

logger = logging.getLogger(__name__)


# Seconds a prefill pool's replica count is reused before Serve is asked again; also how often a decode
# replica waiting on a prefill looks whether the pool is still there.
POOL_CHECK_PERIOD_S = 2.0
# The longest a wake call waits in Serve's queue for a prefill pool at zero to start a replica; a later prompt
# that finds the pool still empty sends another.
WAKE_TIMEOUT_S = 600.0
# The Retry-After of a 503 the prefill pool caused: Serve finds and replaces a failed prefill replica no
# sooner than one health check (a pool starting from zero takes its cold start).
PREFILL_RETRY_AFTER_S = HEALTH_CHECK_PERIOD_S


class PrefillClient(Protocol):
    """How a decode server reaches the prefill pool."""

    async def prefill(self, request: ApiRequest) -> PrefillResult: ...

    async def num_running_replicas(self) -> int | None:
        """Prefill replicas running now; None while unknown."""
        ...

    def wake(self) -> None:
        """Asks a pool at zero for a replica, without waiting for it."""
        ...


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

    async def prefill(self, request: ApiRequest) -> PrefillResult:
        index = self._pick()
        self.in_flight[index] += 1
        try:
            return await self.servers[index].prefill(request)
        finally:
            self.in_flight[index] -= 1

    async def num_running_replicas(self) -> int | None:
        return len(self.servers)

    def wake(self) -> None:
        """In-process servers are all there is: nothing to start."""


class HandlePrefillClient:
    """The prefill deployment through its Serve handle; the pool's request router picks the replica.

    Serve queues a call while a deployment has no running replica, for as long as that lasts (a lost node
    whose slice no other node offers: until one joins); ``num_running_replicas`` lets the decode server
    see that state instead of waiting in that queue.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle.options(**data_path_handle_options())
        self._num_running: int | None = None
        self._checked_at = -POOL_CHECK_PERIOD_S
        # The outstanding wake call, if any: one at a time.
        self._wake: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """Sends the pool one call that Serve queues while it has no replica, and a queued call is what starts a
        deployment at zero: with its decode replicas prefilling locally, nothing else would reach it."""
        if self._wake is None or self._wake.done():
            self._wake = asyncio.ensure_future(self._call_wake())

    async def _call_wake(self) -> None:
        response = self.handle.wake.remote()
        try:
            await asyncio.wait_for(response, WAKE_TIMEOUT_S)
        except TimeoutError:
            response.cancel()
            logger.warning("the prefill pool did not start a replica within %g s of a wake call", WAKE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a failed wake is retried by the next prompt that finds none
            logger.warning("a wake call to the prefill pool failed: %s", error)

    async def num_running_replicas(self) -> int | None:
        """The prefill deployment's RUNNING replicas in Serve's status, at most POOL_CHECK_PERIOD_S old."""
        now = time.monotonic()
        if now - self._checked_at >= POOL_CHECK_PERIOD_S:
            self._checked_at = now  # concurrent callers reuse the last count meanwhile
            self._num_running = await asyncio.get_running_loop().run_in_executor(None, self._count_running)
        return self._num_running

    def _count_running(self) -> int | None:
        try:
            status = serve.status()
        except Exception as error:  # noqa: BLE001 - the controller unreachable (its node lost, restarting)
            # Unknown is not empty: the prefill call goes ahead, bounded by prefill_timeout_s as before.
            logger.warning("the prefill pool's replica count is unknown: %s", error)
            return None
        app = status.applications.get(self.handle.app_name)
        deployment = app.deployments.get(self.handle.deployment_name) if app is not None else None
        return deployment.replica_states.get("RUNNING", 0) if deployment is not None else None

    async def prefill(self, request: ApiRequest) -> PrefillResult:
        response = self.handle.prefill.remote(request)
        try:
            return await response
        except asyncio.CancelledError:
            # The client left during prefill: stop the prefill too, so its KV is not held for nobody.
            response.cancel()
            raise


def _unavailable(message: str) -> EngineRequestError:
    return EngineRequestError(message, status_code=503, error_type="service_unavailable",
                              code="prefill_unavailable", retry_after_s=PREFILL_RETRY_AFTER_S)


class PrefillPoolEmpty(Exception):
    """The prefill pool has no running replica: a prefill call would wait in Serve's queue for one."""


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
        # Whether the last prompt was prefilled here for want of a prefill replica (logged on each change).
        self._prefilling_locally = False
        # A prefill pool that scales to zero gets no prefill while empty, so a prompt that finds it empty wakes it.
        scaling = self.settings.prefill.autoscaling
        self._prefill_scales_to_zero = scaling is not None and scaling.min_replicas == 0

    async def _remote_prefill(self, request: ApiRequest, payload: dict[str, Any]) -> PrefillResult:
        """The prefill pool's KV for the request's prompt, tried up to max_prefill_attempts times.

        Raises:
            EngineRequestError: every attempt failed (503).
            PrefillPoolEmpty: the pool has no running replica (before or during an attempt).
        """
        body = prefill_body(payload, request.endpoint)
        # The hints did not travel with the request (they are never pickled): the prefill pool's
        # cache-aware router needs them rebuilt from the body here.
        model = payload.get("model")
        adapter = model if isinstance(model, str) and model != self.model.name else None
        try:
            routing = read_fields(request.endpoint, payload).routing_hints(None, adapter)
        except APIError:
            routing = RoutingHints()
        errors: list[str] = []
        for attempt in range(1, self.settings.max_prefill_attempts + 1):
            # Each attempt is a new engine request: a half-finished one may still be running elsewhere.
            attempt_request = ApiRequest(f"{request.request_id}-p{attempt}", request.endpoint, body,
                                         priority=request.priority, routing=routing)
            try:
                return await self._prefill_while_pool_runs(attempt_request)
            except PrefillPoolEmpty:
                raise
            except TimeoutError:
                errors.append(f"no answer within prefill_timeout_s={self.settings.prefill_timeout_s:g}")
            except Exception as error:  # noqa: BLE001 - a dead or failing prefill replica: try another
                errors.append(f"{type(error).__name__}: {error}"[:300])
                dead = dead_replica_id(error)
                if dead is not None:
                    routing = dataclasses.replace(routing, avoid_replica_ids=routing.avoid_replica_ids | {dead})
            logger.warning("prefill attempt %d/%d for %s failed: %s", attempt,
                           self.settings.max_prefill_attempts, request.request_id, errors[-1])
        raise _unavailable(f"prefill failed on {len(errors)} attempt(s); retry after {PREFILL_RETRY_AFTER_S} s. "
                          f"Last error: {errors[-1]}")

    async def _prefill_while_pool_runs(self, request: ApiRequest) -> PrefillResult:
        """One prefill call, bounded by prefill_timeout_s, abandoned once the pool has no running replica.

        Raises:
            TimeoutError: no answer within prefill_timeout_s.
            PrefillPoolEmpty: the pool has no running replica.
        """
        if await self.prefill_client.num_running_replicas() == 0:
            raise PrefillPoolEmpty
        call = asyncio.ensure_future(self.prefill_client.prefill(request))
        deadline = time.monotonic() + self.settings.prefill_timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait({call}, timeout=min(POOL_CHECK_PERIOD_S, remaining))
                if done:
                    return call.result()
                if await self.prefill_client.num_running_replicas() == 0:
                    raise PrefillPoolEmpty
        finally:
            call.cancel()  # a no-op once it is done; else the prefill replica stops it too

    def _note_prefill_pool(self, running: bool) -> None:
        """Records whether the prefill pool ran for the last prompt; with none running, refuses the request
        (``prefill_pool_empty: refuse``) or counts it as prefilled here.

        Raises:
            EngineRequestError: the pool has no running replica and the model refuses then (503).
        """
        if not running and self._prefill_scales_to_zero:
            self.prefill_client.wake()
        if not running and self.settings.prefill_pool_empty == "refuse":
            raise _unavailable(f"the prefill pool has no running replica; retry after {PREFILL_RETRY_AFTER_S} s")
        if running == self._prefilling_locally:  # the pool's state changed
            logger.warning("the prefill pool runs again; prefilling there" if running else
                           "the prefill pool has no running replica; prefilling here until one runs")
        self._prefilling_locally = not running
        if not running:
            self.metrics.local_prefills.inc()

    async def _num_prompt_tokens(self, request: ApiRequest, payload: dict[str, Any]) -> int:
        """The prompt's length from vLLM's own /tokenize: as the engine renders it for chat and completions;
        for Anthropic messages and Responses input, their text rendered as chat messages (tool blocks and
        items other than text are not counted)."""
        body = _tokenize_body(request.endpoint, payload)
        if isinstance(body, int):
            return body
        head, tokens = await self.respond(ApiRequest(f"{request.request_id}-t", Endpoint.TOKENIZE,
                                                     json.dumps(body).encode()))
        if head.status_code != 200:
            return 0  # the request itself will get vLLM's error when run locally
        return int(json.loads(tokens).get("count", 0))

    async def _prefills_remotely(self, request: ApiRequest, payload: dict[str, Any]) -> bool:
        # Several samples, prompt logprobs and echo need the prompt computed here.
        if (payload.get("n") or 1) > 1 or payload.get("echo") or payload.get("prompt_logprobs") is not None:
            return False
        if request.endpoint is Endpoint.RESPONSES and not _response_prefills_remotely(payload):
            return False
        if self.settings.min_prompt_tokens <= 1:
            return True
        return await self._num_prompt_tokens(request, payload) >= self.settings.min_prompt_tokens

    async def forward(self, request: ApiRequest) -> AsyncIterator[ReplicaChunk]:
        """Streams the request's response; prompts of at least min_prompt_tokens are prefilled remotely.

        A request vLLM refuses at prefill gets vLLM's error as it is; a failed prefill pool, a 503. While the
        pool has no running replica, the prompt is prefilled here (``prefill_pool_empty: prefill_locally``)
        or refused at once (``refuse``) instead of waiting for one.

        Raises:
            EngineRequestError: the prefill pool failed on every attempt, or is empty and refuses (503).
            EngineDeadError: this replica's engine has died (before a prefill replica computes KV for it).
        """
        if self.engine.errored:
            raise EngineDeadError(self.replica_id)
        started_at = time.time()
        refusal = await self._refusal(request, started_at)
        if refusal is not None:
            yield refusal
            return
        payload = None
        if request.endpoint in DISAGGREGATED_ENDPOINTS:
            try:
                payload = json.loads(request.body)
            except ValueError:
                pass  # vLLM's app answers it
        if not isinstance(payload, dict) or not await self._prefills_remotely(request, payload):
            async for chunk in self._run(request, request.body, started_at):
                yield chunk
            return
        try:
            prefill = await self._remote_prefill(request, payload)
        except PrefillPoolEmpty:
            self._note_prefill_pool(running=False)
            async for chunk in self._run(request, request.body, started_at):
                yield chunk
            return
        self._note_prefill_pool(running=True)
        if prefill.error_status is not None:
            yield ReplicaChunk(prefill.error_body, head=ResponseHead(
                prefill.error_status, "application/json", self.replica_id, started_at, prefill.replica_id),
                final=True)
            return
        body = json.dumps({**payload, "kv_transfer_params": prefill.kv_transfer_params}).encode()
        async for chunk in self._run(request, body, started_at, prefill.replica_id):
            yield chunk


def _response_prefills_remotely(payload: dict[str, Any]) -> bool:
    """Whether a Responses request may be prefilled on another replica. Not when it continues a stored
    response or conversation (the store is this replica's, not the prefill replica's); not with built-in
    tools (several turns on one request would each pull the first turn's KV again); not in the background
    (refused here at once, rather than after a prefill whose KV would wait out its lease: by vLLM without its
    response store, by the replica's request check with it)."""
    if payload.get("previous_response_id") or payload.get("conversation"):
        return False
    if any(not isinstance(tool, dict) or tool.get("type") != "function" for tool in payload.get("tools") or []):
        return False
    return not payload.get("background")


_TOKENIZE_KEYS = ("model", "messages", "prompt", "tools", "chat_template", "chat_template_kwargs",
                  "add_generation_prompt", "continue_final_message", "add_special_tokens")


def _tokenize_body(endpoint: Endpoint, payload: dict[str, Any]) -> dict[str, Any] | int:
    """A /tokenize body for the request's prompt, or its length when the body holds token ids (0 when the
    prompt cannot be read: the request then runs here and gets vLLM's own error)."""
    if endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
            return len(prompt)
        return {key: payload[key] for key in _TOKENIZE_KEYS if key in payload}
    try:
        fields = read_fields(endpoint, payload)
    except APIError:
        return 0
    if fields.messages is not None:
        return {"model": fields.model, "messages": fields.messages}
    if isinstance(fields.prompt, list):
        return len(fields.prompt)
    instructions = payload.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    return {"model": fields.model, "messages": [*system, {"role": "user", "content": fields.prompt or ""}]}


@serve.deployment
class DecodeDeployment(KVTransferReplica, DecodeServer):
    """Ray Serve replica of a decode server; the ingress reaches it as the model's engine deployment."""

    async def __init__(self, model: ModelConfig, cpu_bindings: list[str] | None = None,  # type: ignore[misc]
                       model_path: str | None = None, metrics_hub: Any = None, prefill: Any = None,
                       engine_cls: type[Engine] = Engine) -> None:
        config = model.pool_model("decode")
        replica_id, binding = self._replica_identity(config, cpu_bindings)
        super().__init__(config, prefill_client=HandlePrefillClient(prefill), kv_transfer=self._kv_transfer(config),
                         replica_id=replica_id, cpu_binding=binding, model_path=model_path, engine_cls=engine_cls,
                         kv_events_port=self._kv_events_port(config))
        await self._start_replica_tasks(metrics_hub)
