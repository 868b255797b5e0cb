"""Replica selection policies: which replica of a model serves a request.

Pure Python (no Ray); the Serve request router in ``serve_adapter.py`` feeds them replica loads and
prompt text. ``CacheAwarePolicy`` has the shape of SGLang's cache-aware router: a load-imbalance
check with named thresholds comes first, then prefix-cache affinity, then LoRA adapter affinity, then load.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from fleetserve.platform.config import RoutingConfig
from fleetserve.router.replica.prefix_index import PrefixIndex

Reason = Literal["cache_hit", "adapter", "load", "imbalance", "session", "round_robin", "power_of_two"]


class NoReplicaError(RuntimeError):
    """No live replica to route to."""


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows about one live replica."""

    replica_id: str
    # Requests routed to it that have not completed, as the router counted them.
    num_outstanding: int = 0
    # KV-cache usage its engine last reported, 0-1; None before the first report.
    kv_cache_usage: float | None = None
    # The LoRA adapters its engine last reported holding.
    adapter_names: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen replica and why."""

    replica_id: str
    reason: Reason
    # Share of the prompt's prefix blocks the chosen replica is believed to hold.
    match_ratio: float = 0.0


class ReplicaPolicy(Protocol):
    """What Serve's request router (``serve_adapter``) runs for each request."""

    def choose(self, text: str, replicas: Sequence[ReplicaLoad], session_id: str | None = None,
               adapter: str | None = None) -> RoutingDecision:
        """Picks one of ``replicas`` for a request.

        Args:
            text: the routing key: the prompt's text, or its token ids when keyed by the engines' KV events.
            replicas: every live replica's load, as the router sees it now.
            session_id: the request's session (x-session-id, ``prompt_cache_key``, ``user`` or Anthropic's
                ``metadata.user_id``), for session affinity.
            adapter: the LoRA adapter the request asks for; None for the base model.

        Raises:
            NoReplicaError: when ``replicas`` is empty.
        """
        ...

    def forget(self, live_replica_ids: Sequence[str]) -> None:
        """Drops what the policy holds about replicas that are no longer in ``live_replica_ids``."""
        ...


def _least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    # Outstanding requests first; KV usage breaks ties (a fuller cache leaves less room); id keeps it deterministic.
    return min(replicas, key=lambda r: (r.num_outstanding, r.kv_cache_usage or 0.0, r.replica_id))


def _require(replicas: Sequence[ReplicaLoad]) -> None:
    if not replicas:
        raise NoReplicaError("no live replica to route to")


# The thresholds' defaults are the platform config's (routing:), which follow SGLang's router.
_DEFAULT_ROUTING = RoutingConfig()


@dataclass(frozen=True)
class CacheAwareThresholds:
    """When cache affinity may win over load."""

    # Load counts as imbalanced only if max - min outstanding requests exceeds this ...
    balance_abs_threshold: int = _DEFAULT_ROUTING.balance_abs_threshold
    # ... and max exceeds min x this. Then the least-loaded replica wins regardless of cache.
    balance_rel_threshold: float = _DEFAULT_ROUTING.balance_rel_threshold
    # The best-matching replica wins only if it holds at least this share of the prompt's blocks.
    cache_threshold: float = _DEFAULT_ROUTING.cache_threshold

    @classmethod
    def of(cls, routing: RoutingConfig) -> CacheAwareThresholds:
        """The thresholds a model's ``routing:`` sets."""
        return cls(routing.balance_abs_threshold, routing.balance_rel_threshold, routing.cache_threshold)


class CacheAwarePolicy:
    """Prefix-cache-aware and adapter-aware routing guarded by a load-imbalance check.

    A request for a LoRA adapter with no prefix hit goes to the least loaded replica holding the adapter: its
    engine reports it, or it is the adapter's home (where this router last sent it; fresher than any report).
    At equal load the home wins. A new adapter goes to the equally loaded replica that is home to the
    fewest, so adapters spread over replicas instead of evicting each other from one engine's cache. vLLM's prefix cache
    is per adapter, and the ingress keys an adapter's prompts apart, so a prefix hit implies the adapter too.

    Args:
        thresholds: when affinity may win over load.
        index: which prefixes each replica holds: the approximate ``PrefixIndex`` over prompt text (the
            default), or a ``kv_events.KVEventIndex`` over token ids, fed by the engines' own events.
            ``choose``'s ``text`` is whatever key the index hashes.
    """

    def __init__(self, thresholds: CacheAwareThresholds | None = None, index: PrefixIndex | None = None) -> None:
        self.thresholds = thresholds or CacheAwareThresholds()
        self.index = index or PrefixIndex()
        # adapter -> the replica this router last sent it to (engines report what they hold once a period).
        self._adapter_homes: dict[str, str] = {}

    def is_imbalanced(self, replicas: Sequence[ReplicaLoad]) -> bool:
        loads = [replica.num_outstanding for replica in replicas]
        high, low = max(loads), min(loads)
        return (high - low > self.thresholds.balance_abs_threshold
                and high > low * self.thresholds.balance_rel_threshold)

    def choose(self, text: str, replicas: Sequence[ReplicaLoad], session_id: str | None = None,
               adapter: str | None = None) -> RoutingDecision:
        _require(replicas)
        hashes = self.index.hashes(text)
        matches = {match.replica_id: match for match in self.index.match(hashes, [r.replica_id for r in replicas])}
        if len(replicas) > 1 and self.is_imbalanced(replicas):
            chosen, reason = _least_loaded(replicas), "imbalance"
        else:
            # Longest match first; among equal matches, the less loaded.
            best = max(replicas, key=lambda r: (matches[r.replica_id].num_matched_blocks, -r.num_outstanding,
                                                -(r.kv_cache_usage or 0.0)))
            holders = self._holders(adapter, replicas)
            homes = Counter(self._adapter_homes.values())
            if matches[best.replica_id].ratio >= self.thresholds.cache_threshold:
                chosen, reason = best, "cache_hit"
            elif holders:
                # At equal load the adapter's home wins (no reload, even where reports lag); an adapter every
                # replica holds spreads like least-loaded.
                home = self._adapter_homes.get(adapter)
                chosen = min(holders, key=lambda r: (r.num_outstanding, r.replica_id != home, homes[r.replica_id],
                                                     r.kv_cache_usage or 0.0, r.replica_id))
                reason = "adapter"
            else:
                # Among equally loaded replicas, the one caching least (fewest adapters, then fewest prefix
                # blocks) has the most room (SGLang's smallest-tree rule); without it every new prefix or
                # adapter lands on the same replica.
                chosen = min(replicas, key=lambda r: (r.num_outstanding, homes[r.replica_id],
                                                      self.index.num_blocks(r.replica_id),
                                                      r.kv_cache_usage or 0.0, r.replica_id))
                reason = "load"
        self.index.insert(chosen.replica_id, hashes)
        if adapter is not None:
            self._adapter_homes[adapter] = chosen.replica_id
        return RoutingDecision(chosen.replica_id, reason, matches[chosen.replica_id].ratio)

    def _holders(self, adapter: str | None, replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
        """The replicas that hold an adapter: those reporting it, and its home."""
        if adapter is None:
            return []
        home = self._adapter_homes.get(adapter)
        return [r for r in replicas if adapter in r.adapter_names or r.replica_id == home]

    def forget(self, live_replica_ids: Sequence[str]) -> None:
        self.index.retain(live_replica_ids)
        live = set(live_replica_ids)
        self._adapter_homes = {name: home for name, home in self._adapter_homes.items() if home in live}


class SessionAffinityPolicy:
    """Keeps each session on one replica while that replica lives; new sessions go by ``inner``."""

    def __init__(self, inner: ReplicaPolicy | None = None, max_sessions: int = 100_000) -> None:
        self.inner = inner or LeastLoadedPolicy()
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def choose(self, text: str, replicas: Sequence[ReplicaLoad], session_id: str | None = None,
               adapter: str | None = None) -> RoutingDecision:
        _require(replicas)
        if session_id is not None:
            pinned = self._sessions.get(session_id)
            if pinned is not None and any(replica.replica_id == pinned for replica in replicas):
                self._sessions.move_to_end(session_id)
                return RoutingDecision(pinned, "session")
        decision = self.inner.choose(text, replicas, session_id, adapter)
        if session_id is not None:
            self._sessions[session_id] = decision.replica_id
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return decision

    def forget(self, live_replica_ids: Sequence[str]) -> None:
        live = set(live_replica_ids)
        for session_id in [s for s, replica_id in self._sessions.items() if replica_id not in live]:
            del self._sessions[session_id]
        self.inner.forget(live_replica_ids)


class LeastLoadedPolicy:
    """Fewest outstanding requests."""

    def choose(self, text: str, replicas: Sequence[ReplicaLoad], session_id: str | None = None,
               adapter: str | None = None) -> RoutingDecision:
        _require(replicas)
        return RoutingDecision(_least_loaded(replicas).replica_id, "load")

    def forget(self, live_replica_ids: Sequence[str]) -> None:
        pass


class RoundRobinPolicy:
    """Each replica in turn, ignoring load and cache."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, text: str, replicas: Sequence[ReplicaLoad], session_id: str | None = None,
               adapter: str | None = None) -> RoutingDecision:
        _require(replicas)
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        return RoutingDecision(ordered[next(self._counter) % len(ordered)].replica_id, "round_robin")

    def forget(self, live_replica_ids: Sequence[str]) -> None:
        pass


class PowerOfTwoPolicy:
    """Two random replicas, the less loaded of them (Ray Serve's default idea)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, text: str, replicas: Sequence[ReplicaLoad], session_id: str | None = None,
               adapter: str | None = None) -> RoutingDecision:
        _require(replicas)
        sample = self._rng.sample(list(replicas), min(2, len(replicas)))
        return RoutingDecision(_least_loaded(sample).replica_id, "power_of_two")

    def forget(self, live_replica_ids: Sequence[str]) -> None:
        pass


POLICIES = ("cache_aware", "session", "round_robin", "power_of_two", "least_loaded")


def make_policy(routing: RoutingConfig, index: PrefixIndex | None = None) -> ReplicaPolicy:
    """The policy a model's ``routing:`` names; its thresholds and the prefix index apply to cache_aware
    (and session's fallback for new sessions). The schema admits only known policies."""
    name = routing.policy
    if name == "cache_aware":
        return CacheAwarePolicy(CacheAwareThresholds.of(routing), index)
    if name == "session":
        return SessionAffinityPolicy(CacheAwarePolicy(CacheAwareThresholds.of(routing), index))
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    return PowerOfTwoPolicy()
