"""Admission control: a bounded queue in front of a model's engines, sized from what the engines report.

A request is admitted when the work already queued for the model would drain within
``limits.max_queue_wait_s`` at the rate the engines are finishing requests. Beyond that, the caller gets
a 503 with a Retry-After at once, instead of queueing without bound until it times out. Plain
classes (no Ray): the ingress feeds in engine snapshots and asks before each request.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.config import LimitsConfig, ModelConfig
from fleetserve.platform.replica_report import ReplicaReport

# Mean KV usage at or above which engines cannot start more requests (they would preempt), so requests
# sent to them wait; below it, and with nothing waiting, engines start what they are sent at once.
KV_SATURATED = 0.9
# max_num_seqs of a replica that has not reported its own, when the config leaves it to vLLM (vLLM's least
# default: one CPU rank's).
DEFAULT_MAX_NUM_SEQS = 128
# Seconds of engine snapshots the completion rate is measured over.
RATE_WINDOW_S = 10.0
# Bounds on the Retry-After a rejected caller is given.
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


def _retry_after(excess: int, rate: float) -> int:
    """Seconds until ``excess`` requests drain at ``rate`` per second, within the Retry-After bounds."""
    retry = math.ceil(excess / rate) if rate > 0 else MIN_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, retry))


@dataclass(frozen=True)
class AdmissionDecision:
    """Why a request was admitted or refused; the numbers are those the rule compared."""

    admitted: bool
    # Requests queued for the model, this one included: waiting in an engine, or admitted here and
    # still without a first token.
    num_queued: int
    # How many may queue now: the engines' completion rate × max_queue_wait_s, at least the floor.
    # None when the queue is not bounded (no engine report yet, or max_queue_wait_s is off).
    queue_allowance: int | None
    # Requests the ingress has admitted and not finished, this one included.
    num_in_flight: int
    # Hard ceiling on num_in_flight (max_in_flight_per_replica × max serving replicas); None: none.
    in_flight_bound: int | None
    # Seconds the caller should wait before retrying; None when admitted.
    retry_after_s: int | None = None
    # Set when refused for the tenant's fair share: the queue places that share is.
    tenant_share: int | None = None
    # Set when a batch request was refused: the queue places batch work may fill.
    batch_places: int | None = None


@dataclass(frozen=True)
class TenantClass:
    """A request's tenant, as admission, fair queuing (``FairQueue``) and the slot gate (``SlotGate``) weigh it."""

    # The tenant's name.
    tenant: str
    # Its weight over the sum of all tenants' weights, 0-1.
    share: float
    # A batch tenant's requests may fill only limits.fair_share_from of the queue, run after all interactive
    # work, and never take a reserved engine slot.
    batch: bool = False
    # The request's fair-queuing start tag (``FairQueue``), once admitted: lower goes first.
    tag: float = 0.0


class AdmissionController:
    """Decides admission for one model.

    Args:
        model: the model's config (its serving replicas and max_num_seqs).
        limits: the platform's limits.
        clock: monotonic seconds.
        num_parts: ingress replicas sharing the hard in-flight bound: this one admits its equal part (the
            queue bound needs no split: the engines' waiting counts it reads are every replica's).
    """

    def __init__(self, model: ModelConfig | None, limits: LimitsConfig, clock=time.monotonic,
                 num_parts: int = 1) -> None:
        self.limits = limits
        self.clock = clock
        self.num_parts = num_parts
        self.max_serving_replicas = model.max_serving_replicas if model is not None else 1
        serving = model.serving_model() if model is not None else None
        seqs = serving.engine_args.max_num_seqs if serving is not None else None
        self.max_num_seqs = seqs or DEFAULT_MAX_NUM_SEQS
        self.loads: list[ReplicaReport] = []
        # (monotonic time, finished count per replica id), newest last, spanning RATE_WINDOW_S.
        self._history: deque[tuple[float, dict[str, int]]] = deque()

    def observe(self, loads: list[ReplicaReport]) -> None:
        """Takes the engines' latest reports (all pools of the model)."""
        now = self.clock()
        self.loads = loads
        self._history.append((now, {load.replica_id: load.num_finished for load in loads}))
        while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW_S:
            self._history.popleft()

    def num_serving(self) -> int | None:
        """Serving replicas (colocated or decode) in the latest reports; None before the first."""
        return len(self._serving()) if self._history else None

    def completion_rate(self) -> float:
        """Requests the engines finished per second over the window; replicas in both ends only, so a
        restarted or new replica's counter does not count as a burst of completions."""
        if len(self._history) < 2:
            return 0.0
        (start, before), (end, after) = self._history[0], self._history[-1]
        if end <= start:
            return 0.0
        finished = sum(max(0, after[rid] - before[rid]) for rid in after.keys() & before.keys())
        return finished / (end - start)

    def _serving(self) -> list[ReplicaReport]:
        return [load for load in self.loads if load.pool in ("colocated", "decode")]

    def num_slots(self) -> int:
        """Requests the serving replicas run at once: each one's max_num_seqs as its engine reports it (vLLM
        sizes it by the hardware where the config leaves it), else the config's; one replica's before any report."""
        serving = self._serving()
        if not serving:
            return self.max_num_seqs
        return sum(load.max_num_seqs or self.max_num_seqs for load in serving)

    def decide(self, num_in_flight: int, num_unstarted: int | None = None,
               tenant: TenantClass | None = None, num_tenant_in_flight: int = 0) -> AdmissionDecision:
        """Whether one more request may join those this ingress already holds.

        Args:
            num_in_flight: requests admitted here and not finished.
            num_unstarted: those of them without a first token yet (queued, or being prefilled);
                None: all of them.
            tenant: the caller's tenant, for weighted fair shares; None: no tenants.
            num_tenant_in_flight: the tenant's requests admitted here and not finished (queued, or streaming:
                both hold a place in the queue's view, which counts requests beyond the engines' slots as
                queued).
        """
        limits = self.limits
        in_flight = num_in_flight + 1
        unstarted = (num_in_flight if num_unstarted is None else num_unstarted) + 1
        bound = (math.ceil(limits.max_in_flight_per_replica * self.max_serving_replicas / self.num_parts)
                 if limits.max_in_flight_per_replica is not None else None)
        serving = self._serving()
        if bound is not None and in_flight > bound:
            return AdmissionDecision(False, in_flight, None, in_flight, bound, MIN_RETRY_AFTER_S)
        if limits.max_queue_wait_s is None or not serving:
            return AdmissionDecision(True, 0, None, in_flight, bound)
        num_replicas = len(serving)
        # Requests this ingress has streaming: fresher than the engines' running counts, which lag a
        # second, so a slot freed since the last report is seen at once.
        started = in_flight - unstarted
        waiting = sum(load.num_waiting for load in self.loads)
        kv_usage = sum(load.kv_cache_usage for load in serving) / num_replicas
        slots = self.num_slots()
        # Engines with nothing waiting and KV to spare start what they are sent, up to max_num_seqs.
        headroom = max(0, slots - started) if waiting == 0 and kv_usage < KV_SATURATED else 0
        # Queued is the largest of three views: the engines' waiting requests (from every ingress); requests
        # here without a first token beyond the free slots; and requests here beyond all the engines' slots,
        # which wait for a slot or for the response path to deliver output the engines already made.
        queued = max(waiting + 1, unstarted - headroom, in_flight - slots)
        rate = self.completion_rate()
        allowance = max(limits.min_queued_per_replica * num_replicas, math.floor(rate * limits.max_queue_wait_s))
        if tenant is not None and tenant.batch and queued > self.limits.fair_share_from * allowance:
            # The rest of the queue is interactive work's; a batch caller retries once its part has room.
            places = math.floor(self.limits.fair_share_from * allowance)
            return AdmissionDecision(False, queued, allowance, in_flight, bound, _retry_after(queued - places, rate),
                                     batch_places=places)
        if queued <= allowance and not self._over_share(tenant, num_tenant_in_flight, queued, allowance, slots):
            return AdmissionDecision(True, queued, allowance, in_flight, bound)
        if queued <= allowance:
            # Refused for its share: retry once about its own excess has drained.
            share = self._share_places(tenant, allowance, slots)
            return AdmissionDecision(False, queued, allowance, in_flight, bound,
                                     _retry_after(num_tenant_in_flight + 1 - share, rate), share)
        return AdmissionDecision(False, queued, allowance, in_flight, bound, _retry_after(queued - allowance, rate))

    @staticmethod
    def _share_places(tenant: TenantClass, allowance: int, slots: int) -> int:
        """The tenant's weighted part of what the model may hold: its engines' slots and the queue."""
        return math.floor(tenant.share * (allowance + slots))

    def _over_share(self, tenant: TenantClass | None, num_tenant_in_flight: int, queued: int, allowance: int,
                    slots: int) -> bool:
        """A tenant joining a queue filled past ``fair_share_from`` beyond its weighted share of it."""
        if tenant is None or queued <= self.limits.fair_share_from * allowance:
            return False
        return num_tenant_in_flight + 1 > self._share_places(tenant, allowance, slots)

    def refusal(self, model: str, decision: AdmissionDecision) -> APIError:
        """The 503 ``overloaded`` error, with its Retry-After header, for a refused request."""
        if decision.batch_places is not None:
            detail = (f"batch requests may fill {decision.batch_places} of its {decision.queue_allowance} queue "
                      f"places, and {decision.num_queued} are queued")
        elif decision.tenant_share is not None:
            detail = (f"your tenant holds its share, {decision.tenant_share} requests in flight, while others "
                      f"wait")
        elif decision.queue_allowance is None:
            detail = f"{decision.in_flight_bound} requests in flight"
        else:
            detail = (f"{decision.num_queued} requests queued; its engines drain about "
                      f"{decision.queue_allowance} in {self.limits.max_queue_wait_s:g} s")
        error = APIError(f"`{model}` is at capacity ({detail}); retry after {decision.retry_after_s} s", 503,
                         "service_unavailable", code="overloaded")
        error.headers = {"Retry-After": str(decision.retry_after_s)}
        return error
