"""The ingress's limits on work: per-request limits, admission control against the engines' queues, and
the in-flight count and progress timeout of every admitted request.

Auth and tenants' rate limits are ``security``'s; this is what protects the engines whoever calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager

from fleetserve.deployments.ingress.admission import AdmissionController, TenantClass
from fleetserve.deployments.ingress.fair_queue import FairQueue
from fleetserve.deployments.ingress.metrics import IngressMetrics
from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.deployments.ingress.request_fields import RequestFields
from fleetserve.deployments.ingress.security import estimated_prompt_tokens
from fleetserve.deployments.ingress.slots import SlotGate
from fleetserve.platform.api_types import ReplicaChunk
from fleetserve.platform.config import LimitsConfig, ModelConfig
from fleetserve.platform.replica_report import ReplicaReport

logger = logging.getLogger(__name__)
# Engines' latest reports per model, for admission control.
LoadSource = Callable[[], Awaitable[dict[str, list[ReplicaReport]]]]
# Seconds between admission control's reads of the engines' reports.
LOAD_REFRESH_S = 0.5


def effective_max_tokens(fields: RequestFields, limits: LimitsConfig, max_model_len: int | None) -> int | None:
    """The output budget a request really has: none on an endpoint that generates nothing; its own; else the
    platform's ``limits.max_tokens`` (which the ingress then sets on the forwarded request, so the engine obeys
    it); else what the model's context leaves after the prompt (~4 characters a token), which is what vLLM
    allows; None when unknown."""
    if not fields.generates:
        return 0
    if fields.max_tokens is not None:
        return fields.max_tokens
    if limits.max_tokens is not None:
        return limits.max_tokens
    if max_model_len is not None:
        return max(0, max_model_len - estimated_prompt_tokens(fields.prompt_text))
    return None


def check_request_limits(fields: RequestFields, limits: LimitsConfig) -> None:
    """Checks one request against the configured per-request limits.

    Raises:
        APIError: 400 naming the limit.
    """
    if fields.num_messages > limits.max_messages:
        raise APIError(f"{fields.num_messages} messages; the limit is {limits.max_messages}", 400,
                       param="messages", code="too_many_messages")
    if limits.max_tokens is not None and fields.max_tokens is not None and fields.max_tokens > limits.max_tokens:
        raise APIError(f"max_tokens is {fields.max_tokens}; the limit is {limits.max_tokens}", 400,
                       param="max_tokens", code="max_tokens_too_large")
    text = fields.prompt_text
    if len(text) > limits.max_prompt_chars:
        raise APIError(f"the prompt has {len(text)} characters; the limit is {limits.max_prompt_chars}", 400,
                       param="messages" if fields.messages is not None else "prompt", code="prompt_too_long")


class WorkLimits:
    """Admission control and in-flight accounting for every served model.

    Args:
        models: the served model names.
        configs: model name -> config (its serving replicas and max_num_seqs).
        limits: the platform's limits.
        metrics: the ingress's metrics (in flight, admission allowance, rejections).
        load_source: returns the engines' latest reports per model; None bounds admission by
            max_in_flight_per_replica alone.
        num_parts: ingress replicas sharing the in-flight bound and the engines' slots: this one takes an
            equal part of each.
    """

    def __init__(self, models: list[str], configs: dict[str, ModelConfig], limits: LimitsConfig,
                 metrics: IngressMetrics, load_source: LoadSource | None = None, num_parts: int = 1) -> None:
        self.limits = limits
        self.num_parts = num_parts
        self.platform_metrics = metrics
        # Requests admitted and not yet finished, per served model.
        self.in_flight: dict[str, int] = {name: 0 for name in models}
        # The same per (model, tenant), for fair shares.
        self.in_flight_by_tenant: Counter[tuple[str, str]] = Counter()
        # Of those, the requests still waiting for their first token (queued or being prefilled).
        self.unstarted: dict[str, int] = {name: 0 for name in models}
        self.admission = {name: AdmissionController(configs.get(name), limits, num_parts=num_parts) for name in models}
        # Start tags of tenants' requests per model: the order the engines (and the slot gates) start them in.
        self.fair = FairQueue()
        # Per model, engine slots held for requests on the fair schedule; none when nothing is reserved.
        self.slots = ({name: SlotGate(limits.num_reserved_slots, self._num_slots(name),
                                      lambda name=name: self.fair.virtual_time.get(name, 0.0)) for name in models}
                      if limits.num_reserved_slots else {})
        self.load_source = load_source
        self._load_refresher: asyncio.Task | None = None
        self._loads_read = asyncio.Event()

    async def _refresh_loads(self) -> None:
        """Feeds the engines' stats to admission control, every LOAD_REFRESH_S, for the ingress's life."""
        while True:
            try:
                loads = await self.load_source()
                for name, controller in self.admission.items():
                    controller.observe(loads.get(name, []))
                    if name in self.slots:
                        self.slots[name].resize(self._num_slots(name))
                self._loads_read.set()
            except Exception:  # noqa: BLE001 - stale stats only loosen admission to its hard bound
                logger.warning("reading engine load for admission control failed; retrying", exc_info=True)
            await asyncio.sleep(LOAD_REFRESH_S)

    async def first_loads(self, timeout_s: float) -> None:
        """Waits, at most ``timeout_s``, for the first reading of the engines' reports (it starts with the first
        admitted request); returns at once once there has been one, or when there is no source to read."""
        if self.load_source is None or self._loads_read.is_set():
            return
        try:
            await asyncio.wait_for(self._loads_read.wait(), timeout_s)
        except TimeoutError:
            logger.warning("no reading of engine load within %g s: going on without it", timeout_s)

    @contextmanager
    def waiting(self, model: str) -> Iterator[None]:
        """Counts a request as unstarted until its first chunk."""
        self.unstarted[model] += 1
        try:
            yield
        finally:
            self.unstarted[model] -= 1

    def admit(self, model: str, tenant: TenantClass | None = None) -> None:
        """Admission control for one request to ``model`` from ``tenant`` (its weighted share and class).

        Raises:
            APIError: 503 ``overloaded`` with Retry-After.
        """
        if self.load_source is not None and self._load_refresher is None:
            self._load_refresher = asyncio.get_running_loop().create_task(self._refresh_loads())
        controller = self.admission[model]
        num_tenant_in_flight = self.in_flight_by_tenant[model, tenant.tenant] if tenant is not None else 0
        decision = controller.decide(self.in_flight[model], self.unstarted[model], tenant, num_tenant_in_flight)
        if not decision.admitted:
            bound = ("batch" if decision.batch_places is not None else
                     "share" if decision.tenant_share is not None else
                     "queue" if decision.queue_allowance is not None else "in_flight")
            self.platform_metrics.rejections.labels(model, bound).inc()
            raise controller.refusal(model, decision)
        if decision.queue_allowance is not None:
            self.platform_metrics.admission_queue.labels(model).set(decision.queue_allowance)

    def _num_slots(self, model: str) -> int:
        """This ingress's part of the model's engine slots (their max_num_seqs over the serving replicas; one
        replica's before the first report) over the ingress replicas, at least one."""
        return max(1, self.admission[model].num_slots() // self.num_parts)

    def num_serving(self, model: str) -> int | None:
        """Serving replicas the engines' reports show for ``model``; None before the first reading."""
        return self.admission[model].num_serving()

    async def guarded(self, model: str, stream: AsyncIterator[ReplicaChunk], tenant: TenantClass | None = None,
                      first_chunk: tuple[float, Callable[[], APIError]] | None = None,
                      generates: bool = True) -> AsyncIterator[ReplicaChunk]:
        """Counts the request as in flight (for its tenant too) while it runs, holds it while it would take
        a slot reserved for others (``SlotGate``), and aborts it when it stops making progress.

        Args:
            first_chunk: (seconds, error) for the first chunk, the hold for a slot included, instead of
                progress_timeout_s: a request held while its pool wakes from zero may wait for the cold
                start, then gets that error.
            generates: whether the request generates, so takes an engine slot (the gate applies) and starts
                on the fair schedule.
        """
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        if tenant is not None:
            self.in_flight_by_tenant[model, tenant.tenant] += 1
        self.platform_metrics.in_flight.labels(model).set(self.in_flight[model])
        gate = self.slots.get(model) if tenant is not None and generates else None
        entered = False
        timeout = self.limits.progress_timeout_s
        first_timeout, first_error = first_chunk if first_chunk is not None else (timeout, None)
        num_chunks = 0
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout if num_chunks else first_timeout):
                        if gate is not None and not entered:
                            await self._enter(model, gate, tenant)
                            entered = True
                        chunk = await anext(stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if first_error is not None and not num_chunks:
                        raise first_error() from None
                    logger.warning("request on %s made no progress for %gs; aborted", model, timeout)
                    raise APIError(f"the request made no progress for {timeout:g} s and was aborted", 504,
                                   "timeout_error", code="no_progress") from None
                num_chunks += 1
                if num_chunks == 1 and tenant is not None and generates:
                    self._started(model, tenant.tag)
                if chunk.heartbeat:  # progress on a response not yet started: nothing to pass on
                    continue
                if entered and chunk.final:
                    # The engine is done with it: its slot is free before the rest reaches the client.
                    gate.leave(tenant.tenant)
                    entered = False
                yield chunk
        finally:
            self.in_flight[model] -= 1
            if tenant is not None:
                self.in_flight_by_tenant[model, tenant.tenant] -= 1
            if entered:
                gate.leave(tenant.tenant)
            self.platform_metrics.in_flight.labels(model).set(self.in_flight[model])
            await stream.aclose()

    def _started(self, model: str, tag: float) -> None:
        """An engine started the request tagged ``tag``: the virtual time moves on, and may let held requests go."""
        self.fair.started(model, tag)
        if model in self.slots:
            self.slots[model].wake()

    async def _enter(self, model: str, gate: SlotGate, tenant: TenantClass) -> None:
        """Waits for a slot the tenant may take, with the held count in the metrics."""
        if gate.try_enter(tenant):
            return
        held = self.platform_metrics.slot_held.labels(model)
        held.set(gate.num_held + 1)
        try:
            await gate.hold(tenant)
        finally:
            held.set(gate.num_held)
