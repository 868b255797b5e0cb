"""Ray Serve request router running fleetserve's replica policies. The router package's only Ray import.

Serve runs one router per deployment handle, in the caller's process (the ingress). It counts its
own outstanding requests per replica (as SGLang's router does: fresher than any polled stat) and
reads KV usage from the report each replica publishes through ``record_routing_stats``
(``routing_stats`` writes it, ``RoutingStats`` reads it back: the only dict of this contract).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from fleetserve.router.replica import decisions
from fleetserve.router.replica.kv_events import AdapterTokens, KVEventIndex, KVEventSubscriber
from fleetserve.platform.api_types import ApiRequest, RoutingHints
from fleetserve.platform.config import RoutingConfig
from fleetserve.platform.replica_report import ReplicaReport
from fleetserve.router.replica.policy import ReplicaLoad, make_policy

logger = logging.getLogger(__name__)
# A choice the replica has not accepted after this long belongs to a request cancelled while routing.
CHOICE_TTL_S = 30.0


@dataclass(frozen=True)
class KVEventSource:
    """Where a replica publishes its engine's KV cache events (routing.prefix_source kv_events)."""

    # The ZMQ endpoint routers subscribe to, e.g. tcp://10.0.0.5:5557.
    endpoint: str
    # Tokens per KV block, so the router hashes prompts into the blocks the events describe.
    block_size: int


def routing_stats(report: ReplicaReport, kv_events: KVEventSource | None = None,
                  adapter_names: Sequence[str] = (), engine_dead: bool = False) -> dict[str, Any]:
    """What a replica returns from Serve's ``record_routing_stats`` hook."""
    stats: dict[str, Any] = {"kv_cache_usage": report.kv_cache_usage, "num_running": report.num_running,
                             "num_waiting": report.num_waiting, "adapter_names": list(adapter_names),
                             "engine_dead": engine_dead}
    if kv_events is not None:
        stats.update(kv_events_endpoint=kv_events.endpoint, kv_block_size=kv_events.block_size)
    return stats


@dataclass(frozen=True)
class RoutingStats:
    """A replica's routing stats as the router last received them (None before its first report)."""

    kv_cache_usage: float | None
    kv_events: KVEventSource | None
    # The LoRA adapters its engine holds.
    adapter_names: frozenset[str] = frozenset()
    # Its engine has died: it fails every request until Serve's health check replaces it.
    engine_dead: bool = False

    @classmethod
    def of(cls, replica: RunningReplica) -> RoutingStats:
        stats = replica.routing_stats or {}
        events = (KVEventSource(stats["kv_events_endpoint"], int(stats["kv_block_size"]))
                  if "kv_events_endpoint" in stats else None)
        return cls(stats.get("kv_cache_usage"), events, frozenset(stats.get("adapter_names", ())),
                   bool(stats.get("engine_dead", False)))


def serving_candidates(candidates: list[RunningReplica], avoid_replica_ids: frozenset[str]) -> list[RunningReplica]:
    """The candidates without those whose engine has died or that failed this request already, unless that
    leaves none: a dead replica then answers at once that it cannot serve, where waiting would hang."""
    kept = [replica for replica in candidates if not RoutingStats.of(replica).engine_dead
            and replica.replica_id.unique_id not in avoid_replica_ids]
    return kept or candidates


def routing_hints(request: Any) -> RoutingHints | None:
    """The routing hints of a request Serve is routing: an ``ApiRequest``'s, in the process that made it."""
    return request.routing if isinstance(request, ApiRequest) else None


def request_text(request: Any) -> tuple[str, str | None, str | None]:
    """The routing key text of an ApiRequest (its prompt, or its messages in order), its session, and the
    LoRA adapter it asks for."""
    routing = routing_hints(request)
    if routing is None:
        return "", None, None
    return routing.prefix_text, routing.session_id, routing.adapter


class EventKeys:
    """Routing keys for prefix_source kv_events: each request's prompt token ids, tokenized exactly as the
    engine does, and a subscription to every replica's KV event stream."""

    def __init__(self, tokenizer_source: str, chat_template: str | None = None,
                 tokenizer_revision: str | None = None) -> None:
        from transformers import AutoTokenizer

        from fleetserve.platform.engine import KV_EVENTS_TOPIC
        from fleetserve.platform.model_store import HubFetch, resolve_source

        folder = resolve_source(tokenizer_source, hub=HubFetch(revision=tokenizer_revision))
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        # The replicas' chat template (the model's api.chat_template), so chats key as the engine renders them.
        self.chat_template = chat_template
        self.index = KVEventIndex()
        self.subscriber = KVEventSubscriber(self.index, topic=KV_EVENTS_TOPIC)

    def follow(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            events = RoutingStats.of(replica).kv_events
            if events is not None:
                self.subscriber.follow(replica.replica_id.unique_id, events.endpoint)
                self.index.block_size = self.index.block_size or events.block_size

    def key(self, request: Any) -> list[int] | AdapterTokens:
        """The prompt's token ids, under the adapter the request names (its blocks are the adapter's)."""
        routing = routing_hints(request)
        if routing is None:
            return []
        token_ids = self._token_ids(routing)
        return AdapterTokens(routing.adapter, token_ids) if routing.adapter is not None else token_ids

    def _token_ids(self, routing: RoutingHints) -> list[int]:
        from fleetserve.platform.engine import chat_token_ids

        if routing.messages is not None:
            try:
                return chat_token_ids(self.tokenizer, routing.messages, self.chat_template)
            except ValueError:
                return []  # the engine will reject it; any replica can say so
        prompt = routing.prompt
        return list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt or [])


class FleetserveRequestRouter(RequestRouter):
    """Chooses replicas with a ``fleetserve.router.replica.policy`` policy.

    Without Serve's FIFOMixin: a replica found for one request goes to that request (Serve's exact match by
    request id). FIFO hands it to the oldest pending request instead and cancels that request's own routing
    task, so in a burst a choice of a replica whose queue length Serve is still probing can be cancelled by
    a choice of one it has cached: a CI run saw all 12 of a burst's requests land on one of two replicas.
    """

    def initialize_state(self, routing: dict[str, Any] | None = None, tokenizer_source: str | None = None,
                         chat_template: str | None = None, tokenizer_revision: str | None = None) -> None:
        """Serve's request_router_kwargs: the model's ``routing:`` (as a dict: Serve's kwargs are JSON), and
        for kv_events routing the tokenizer (and its Hub revision) and chat template its engines use."""
        config = RoutingConfig.model_validate(routing or {})
        self.event_keys = (EventKeys(tokenizer_source, chat_template, tokenizer_revision)
                           if config.prefix_source == "kv_events" else None)
        index = self.event_keys.index if self.event_keys is not None else None
        self.policy = make_policy(config, index)
        # Requests each replica accepted and has not finished.
        self.outstanding: Counter[str] = Counter()
        # internal request id -> the replica it was routed to, until it completes.
        self._routed: dict[str, str] = {}
        # internal request id -> (the replica chosen for it, when): chosen, not yet accepted. Serve reports a
        # request routed only once the replica accepts it, a round trip later; without these, every request of
        # a burst sees the same loads and goes to the same replica.
        self._chosen: dict[str, tuple[str, float]] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = [replica.replica_id.unique_id for replica in replicas]
        self.policy.forget(live)
        if self.event_keys is not None:
            for replica_id in set(self.event_keys.subscriber.followed()) - set(live):
                self.event_keys.subscriber.unfollow(replica_id)
        for replica_id in [key for key in self.outstanding if key not in live]:
            del self.outstanding[replica_id]
        self._chosen = {key: choice for key, choice in self._chosen.items() if choice[0] in live}
        self._routed = {key: replica_id for key, replica_id in self._routed.items() if replica_id in live}

    def _num_in_flight(self) -> Counter[str]:
        """Accepted plus chosen-but-not-yet-accepted requests per replica; choices older than
        ``CHOICE_TTL_S`` (a request cancelled while routing) are dropped."""
        horizon = time.monotonic() - CHOICE_TTL_S
        self._chosen = {key: choice for key, choice in self._chosen.items() if choice[1] >= horizon}
        return self.outstanding + Counter(replica_id for replica_id, _ in self._chosen.values())

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> Sequence[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None or not pending_request.args:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        request = pending_request.args[0]
        hints = routing_hints(request)
        candidate_replicas = serving_candidates(candidate_replicas,
                                                hints.avoid_replica_ids if hints is not None else frozenset())
        text, session_id, adapter = request_text(request)
        if self.event_keys is not None:
            self.event_keys.follow(candidate_replicas)
            text = self.event_keys.key(request)
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        stats = {replica_id: RoutingStats.of(replica) for replica_id, replica in by_id.items()}
        internal_id = pending_request.metadata.internal_request_id
        self._chosen.pop(internal_id, None)  # routed again after a rejection: its earlier choice is void
        in_flight = self._num_in_flight()
        loads = [ReplicaLoad(replica_id, in_flight[replica_id], stats[replica_id].kv_cache_usage,
                             stats[replica_id].adapter_names) for replica_id in by_id]
        decision = self.policy.choose(text, loads, session_id, adapter)
        self._chosen[internal_id] = (decision.replica_id, time.monotonic())
        decisions.record(request.request_id if isinstance(request, ApiRequest) else None, decision)
        # If the chosen replica is full, Serve tries the rest, least loaded first.
        rest = sorted((load for load in loads if load.replica_id != decision.replica_id),
                      key=lambda load: (load.num_outstanding, load.replica_id))
        return [[by_id[decision.replica_id]]] + [[by_id[load.replica_id]] for load in rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        internal_id = pending_request.metadata.internal_request_id
        self._chosen.pop(internal_id, None)
        self._routed[internal_id] = replica_id.unique_id
        self.outstanding[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        # Serve also calls this for a request its replica rejected, which was never counted.
        self._chosen.pop(internal_request_id, None)
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None and self.outstanding[routed] > 0:
            self.outstanding[routed] -= 1
