"""The engine server: one model's engine, serving vLLM's own OpenAI app, behind a bytes-in, bytes-out contract.

``EngineServer`` is a plain class (tests build it without Ray); ``EngineDeployment`` is the thin
Ray Serve subclass that adds the replica's identity and its CPU binding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import ray
from ray import serve

from fleetserve.autoscaler.serve_adapter import autoscaling_metrics
from fleetserve.deployments.allocator import tune_for_serving
from fleetserve.deployments.serve_options import resolve_handle
from fleetserve.platform.adapter_registry import AdapterOp, AdapterSet
from fleetserve.platform.adapter_root import AdapterNameError, load_error, root_folder, root_source
from fleetserve.platform.api_errors import is_error_event, with_engine_death_errors
from fleetserve.platform.api_types import ApiRequest, ReplicaChunk, ResponseHead
from fleetserve.platform.asgi_call import call_app
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import Engine, EngineDeadError
from fleetserve.platform.kv_transfer import KVTransferSpec
from fleetserve.platform.metrics import EngineMetrics, StartupPhase
from fleetserve.platform.model_store import resolve_source, with_local_draft
from fleetserve.platform.openai_app import responses_store_enabled
from fleetserve.platform.progress import CALL_PROGRESS, CallProgress
from fleetserve.platform.relay import relay, request_headers
from fleetserve.platform.replica_adapters import ReplicaAdapters
from fleetserve.platform.replica_report import ReplicaReport, ReplicaReporter
from fleetserve.platform.stall import StallWatch
from fleetserve.platform.stats import EngineStats
from fleetserve.platform.unread_params import RequestCheck, json_object
from fleetserve.router.replica.serve_adapter import KVEventSource, routing_stats

logger = logging.getLogger(__name__)
# How often a replica publishes its metrics to the hub.
PUBLISH_PERIOD_S = 1.0


class EngineServer:
    """Serves one model from one vLLM engine.

    Args:
        model: the model's platform config.
        engine_cls: the engine class; injected so tests can substitute a fake.
        replica_id: how responses name this server.
        cpu_binding: cores for the engine's CPU worker; None leaves vLLM's default.
        model_path: an already resolved HF folder; None resolves ``model.source`` here.
        kv_transfer: joins KV transfer with peer engines (disaggregated pools); None serves colocated.
        kv_events_port: publishes the engine's KV cache events on this port (routing.prefix_source
            kv_events); None publishes none.
    """

    def __init__(self, model: ModelConfig, *, engine_cls: type[Engine] = Engine, replica_id: str = "local",
                 cpu_binding: str | None = None, model_path: str | Path | None = None,
                 kv_transfer: KVTransferSpec | None = None, kv_events_port: int | None = None) -> None:
        self.model = model
        self.replica_id = replica_id
        self.pool = model.pool
        self.metrics = EngineMetrics(model.name, replica_id, self.pool,
                                     model.lora.max_loras if model.lora is not None else None,
                                     num_speculative_tokens=(model.engine_args.speculative_config or {}).get(
                                         "num_speculative_tokens"))
        # One reporter per reader of this replica's reports: each reads at its own period.
        self._autoscaling_reporter = ReplicaReporter(replica_id, self.pool)
        self._routing_reporter = ReplicaReporter(replica_id, self.pool)
        self._hub_reporter = ReplicaReporter(replica_id, self.pool)
        self.metrics.set_start_time(time.time())
        with self.metrics.startup_phase(StartupPhase.MODEL_FILES):
            path = (Path(model_path) if model_path is not None
                    else resolve_source(model.source, hub=model.hub_fetch))
            model = with_local_draft(model)
        extra = {"kv_transfer": kv_transfer} if kv_transfer is not None else {}
        if kv_events_port is not None:
            extra["kv_events_port"] = kv_events_port
        with self.metrics.startup_phase(StartupPhase.ENGINE):
            self.engine = engine_cls.create(model, path, cpu_binding=cpu_binding, stats_listeners=[self.metrics],
                                            **extra)
        # The model's LoRA adapters (None without lora:); the names the engine holds, for the router.
        self.adapters = ReplicaAdapters(path, model.lora.max_lora_rank) if model.lora is not None else None
        self.resident_adapter_names: list[str] = []
        self.request_check = RequestCheck(self._chat_template(), model.schedules_by_priority, responses_store_enabled())
        self._stall = StallWatch(model.stall_timeout_s) if model.stall_timeout_s is not None else None

    def _chat_template(self) -> str | None:
        from fleetserve.platform.openai_app import chat_template_text

        tokenizer = getattr(self.engine, "tokenizer", None)  # injected test engines may have none
        template = chat_template_text(self.model) or getattr(tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    async def _refusal(self, request: ApiRequest, started_at: float) -> ReplicaChunk | None:
        """The response refusing a request before vLLM runs it, or None to serve it: a 400 for parameters nothing
        would act on (``unread_params``), or the failed load of the adapter-root adapter it names."""
        payload = json_object(request.body)
        body = self.request_check.payload_refusal(request.endpoint, payload)
        if body is not None:
            return ReplicaChunk(body, head=ResponseHead(400, "application/json", self.replica_id, started_at),
                                final=True)
        return await self._root_adapter_refusal(payload, started_at)

    async def _root_adapter_refusal(self, payload: dict[str, Any] | None, started_at: float) -> ReplicaChunk | None:
        """Loads the adapter under the model's adapter root that the request names, the first time this replica
        serves it; an error response when it cannot be loaded (404: no such folder); None to serve the request."""
        root = self.model.lora.adapter_root if self.model.lora is not None else None
        name = payload.get("model") if payload is not None else None
        if root is None or self.adapters is None or not isinstance(name, str):
            return None
        try:
            folder = root_folder(name, self.model.name)
        except AdapterNameError:
            return None  # the ingress refuses names that are paths
        if folder is None:
            return None
        status, body = await self.adapters.ensure(await self._serving_app(), name, root_source(root, folder))
        if status == 200:
            return None
        return ReplicaChunk(load_error(name, status, body),
                            head=ResponseHead(status, "application/json", self.replica_id, started_at), final=True)

    async def _serving_app(self) -> Any:
        """vLLM's app, ready to serve (the Serve replica also waits for its adapters to sync)."""
        return await self.engine.openai_app()

    async def forward(self, request: ApiRequest) -> AsyncIterator[ReplicaChunk]:
        """Runs one API request through vLLM's own OpenAI app; streams its response as coalesced bytes.

        Closing the stream early aborts the request in the engine.
        """
        started_at = time.time()
        refusal = await self._refusal(request, started_at)
        if refusal is not None:
            yield refusal
            return
        async for chunk in self._run(request, request.body, started_at):
            yield chunk

    async def respond(self, request: ApiRequest) -> tuple[ResponseHead, bytes]:
        """The whole response of a request run on this replica's engine (its status and body)."""
        started_at = time.time()
        refusal = await self._refusal(request, started_at)
        if refusal is not None:
            return refusal.head, refusal.data
        chunks = [chunk async for chunk in self._run(request, request.body, started_at) if not chunk.heartbeat]
        return chunks[0].head, b"".join(chunk.data for chunk in chunks)

    async def _run(self, request: ApiRequest, body: bytes, started_at: float,
                   prefill_replica_id: str | None = None) -> AsyncIterator[ReplicaChunk]:
        """The request run through vLLM's app, as chunks of its response.

        Raises:
            EngineDeadError: before any chunk, when the engine has died (another replica can serve it); or
                after some, when vLLM's app raised mid-response because the engine died under it.
        """
        if self.engine.errored:
            raise EngineDeadError(self.replica_id)
        app = await self._serving_app()
        call = CallProgress()
        CALL_PROGRESS.set(call)  # seen by the engine client under vLLM's app, which runs in copies of it
        events = call_app(app, request.endpoint.value, body, request_headers(request))
        head = ResponseHead(0, "", self.replica_id, started_at, prefill_replica_id)
        progress = functools.partial(self.engine.num_generated_tokens, call.request_ids)
        async with aclosing(relay(events, head, request.strip_usage, progress)) as chunks:
            try:
                async for chunk in chunks:
                    yield self._checked(request, chunk)
            except Exception:
                if self.engine.errored:  # vLLM's own error says nothing a client can use
                    raise EngineDeadError(self.replica_id) from None
                raise

    def _checked(self, request: ApiRequest, chunk: ReplicaChunk) -> ReplicaChunk:
        """A chunk of vLLM's response as the client should get it.

        Raises:
            EngineDeadError: the head of vLLM's 5xx, or of a stream that begins with its error event, for a
                request its engine, dead meanwhile, could not take.
        """
        if chunk.heartbeat:
            return chunk
        if self.engine.errored:
            if chunk.head is not None and (chunk.head.status_code >= 500 or is_error_event(chunk.data)):
                raise EngineDeadError(self.replica_id)  # nothing was generated: another replica can take it
            # A stream the engine died during: say so, where vLLM points at a stack trace the client lacks.
            chunk = dataclasses.replace(chunk, data=with_engine_death_errors(chunk.data, self.replica_id,
                                                                             request.endpoint))
        if chunk.head is None:
            return chunk
        if chunk.head.status_code == 404 and chunk.data.startswith(b'{"detail"'):
            # vLLM's app has no such route for this model (FastAPI's own 404): say so in OpenAI's form.
            chunk = dataclasses.replace(chunk, data=json.dumps({"error": {
                "message": f"model `{self.model.name}` does not serve {request.endpoint.value}",
                "type": "not_found_error", "param": None, "code": "endpoint_not_served"}}).encode())
        return chunk

    async def change_adapter(self, op: AdapterOp, name: str, source: str | None = None,
                             load_inplace: bool = False) -> tuple[int, bytes]:
        """Loads or unloads one LoRA adapter on this replica, with vLLM's semantics.

        Returns:
            The status code and body (vLLM's success text, or OpenAI error JSON).
        """
        if self.adapters is None:
            return 400, json.dumps({"error": {
                "message": f"model `{self.model.name}` serves no LoRA adapters: add lora: to its config",
                "type": "invalid_request_error", "param": "model", "code": "lora_not_enabled"}}).encode()
        return await self.adapters.change(await self._serving_app(), op, name, source, load_inplace)

    async def sync_adapters(self, desired: AdapterSet) -> None:
        """Converges this replica on the registry's adapter set, then notes which adapters the engine holds."""
        if self.adapters is None:
            return
        app = await self.engine.openai_app()
        if desired.version != self.adapters.version:
            await self.adapters.sync(app, desired)
        self.resident_adapter_names = await self.adapters.resident(app, self.engine)

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def check_health(self) -> None:
        """Raises if the engine has died, or has stalled for longer than the model's ``stall_timeout_s``."""
        await self.engine.check_health()
        if self._stall is not None:
            self._stall.check(self.engine.num_unfinished_requests, self.engine.stats().updated_at, time.time())

    def report(self, reporter: ReplicaReporter) -> ReplicaReport:
        """This replica's report to one reader, its rates over the interval since that reader's previous one."""
        return reporter.report(self.engine.stats(), self.engine.num_pending_prompt_tokens, self.engine.max_num_seqs)

    def autoscaling_report(self) -> ReplicaReport:
        """What the autoscaling policy reads: KV usage, queues and the prefill backlog now; TTFT and
        tokens/s since the previous call."""
        return self.report(self._autoscaling_reporter)

    async def metrics_exposition(self) -> bytes:
        """This replica's vLLM-named metrics in Prometheus text format."""
        return self.metrics.exposition()

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.engine = None
            engine.shutdown()


class ServeReplica:
    """What every engine replica adds under Ray Serve: identity, CPU binding, metrics publishing, and the
    stats hooks Serve's request router and autoscaler call. Mixed in before a plain server class."""

    def _replica_identity(self, config: ModelConfig, cpu_bindings: list[str] | None) -> tuple[str, str | None]:
        context = serve.get_replica_context()
        binding = cpu_bindings[context.rank.rank % len(cpu_bindings)] if cpu_bindings else None
        logger.info("replica %s of %s (%s pool): cpu binding %s", context.replica_id.unique_id, config.name,
                    config.pool, binding)
        return context.replica_id.unique_id, binding

    async def _start_replica_tasks(self, metrics_hub: Any) -> None:
        """Starts publishing metrics, and builds vLLM's app (with the current adapter set) before the replica
        takes requests.

        A replica whose app cannot build (vLLM refuses a configured adapter at start) fails to start with
        vLLM's reason, rather than starting healthy and answering every request with it.
        """
        self.metrics.set_node(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        loop = asyncio.get_event_loop()
        metrics_hub = resolve_handle(metrics_hub)
        self._hub = metrics_hub
        self._app_warmup = loop.create_task(self._warm_up())
        self._publisher = loop.create_task(self._publish()) if metrics_hub else None
        # Each request's fiber stack, and what a burst leaves in malloc's arenas, back to the kernel.
        self._allocator_trim = tune_for_serving(loop)
        try:
            await self._app_warmup
        except Exception as error:
            self.shutdown()
            raise RuntimeError(f"models[{self.model.name}]: vLLM's OpenAI app did not build: {error}") from error

    async def _warm_up(self) -> Any:
        with self.metrics.startup_phase(StartupPhase.APP):
            app = await self.engine.openai_app()
            if self.adapters is not None and self._hub is not None:
                # A replica started after adapters changed at run time serves the current set from its first
                # request.
                try:
                    await self.sync_adapters(await self._hub.adapter_set.remote(self.model.name))
                except Exception:  # noqa: BLE001 - serve the configured set; the publish loop syncs again
                    logger.warning("adapter sync at start failed; serving the configured adapters", exc_info=True)
        return app

    async def _serving_app(self) -> Any:
        return await self._app_warmup

    async def _publish(self) -> None:
        while self.engine is not None:
            try:
                version = self.adapters.version if self.adapters is not None and self._app_warmup.done() else None
                desired = await self._hub.push.remote(self.replica_id, self.model.name, self.pool,
                                                      self.metrics.exposition(), self.report(self._hub_reporter),
                                                      version)
                if version is not None:
                    await self.sync_adapters(desired)
            except Exception:  # noqa: BLE001 - the hub restarting must not take the engine down
                logger.warning("metrics push or adapter sync failed; retrying", exc_info=True)
            await asyncio.sleep(PUBLISH_PERIOD_S)

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request router reads about this replica, every routing.stats_period_s."""
        if self.engine is None:
            return {}
        endpoint = getattr(self, "_kv_events_endpoint", None)
        events = KVEventSource(endpoint, self.engine.block_size) if endpoint is not None else None
        return routing_stats(self.report(self._routing_reporter), events, self.resident_adapter_names,
                             engine_dead=self.engine.errored)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (every autoscaling metrics_interval_s)."""
        return autoscaling_metrics(self.autoscaling_report()) if self.engine is not None else {}

    def _kv_events_port(self, config: ModelConfig) -> int | None:
        """Leases this replica's KV event port when its model's router follows engine events."""
        if config.routing.prefix_source != "kv_events":
            return None
        from ray.util import get_node_ip_address

        from fleetserve.platform.kv_transfer import lease_side_channel_ports

        # Routers on other nodes subscribe at this node's address; loopback when single-node.
        host = os.environ.get("FLEETSERVE_SIDE_CHANNEL_HOST") or get_node_ip_address()
        port = lease_side_channel_ports(1, host=host)
        self._kv_events_endpoint = f"tcp://{host}:{port}"
        self._kv_events_lease = port
        return port

    def __del__(self) -> None:
        # Serve calls __del__ on graceful shutdown; stopping the engine here lets its worker exit
        # before Ray kills the actor, which is what leaves /dev/shm segments behind.
        if getattr(self, "_publisher", None) is not None:
            self._publisher.cancel()
            self._hub.remove.remote(self.replica_id)
        self.shutdown()
        port = getattr(self, "_kv_events_lease", None)
        if port is not None:
            from fleetserve.platform.kv_transfer import release_side_channel_ports

            release_side_channel_ports(port)


@serve.deployment
class EngineDeployment(ServeReplica, EngineServer):
    """Ray Serve replica of an engine server; its options come from ``serve_options.deployment_options``."""

    async def __init__(self, config: ModelConfig, cpu_bindings: list[str] | None = None,  # type: ignore[misc]
                       model_path: str | None = None, metrics_hub: Any = None,
                       engine_cls: type[Engine] = Engine) -> None:
        replica_id, binding = self._replica_identity(config, cpu_bindings)
        super().__init__(config, engine_cls=engine_cls, replica_id=replica_id, cpu_binding=binding,
                         model_path=model_path, kv_events_port=self._kv_events_port(config))
        await self._start_replica_tasks(metrics_hub)
