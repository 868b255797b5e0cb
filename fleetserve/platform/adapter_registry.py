"""Which LoRA adapters every replica of a base model should serve, and which replicas have caught up.

Replicas converge on the registry's set: one that starts later, or missed a change, loads and unloads
until it serves exactly the current set. The admin API changes the set and waits until every live replica
has applied it. Held by the metrics hub in a Serve app; plain Python here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum


class AdapterOp(str, Enum):
    """A change to a base model's adapter set."""

    LOAD = "load"
    UNLOAD = "unload"


@dataclass(frozen=True)
class AdapterSet:
    """The adapters every replica of one base model should serve."""

    # Bumped on every change; a replica that applied this version serves exactly ``sources``.
    version: int = 0
    # adapter name -> its source (a PEFT folder, or random-lora:<seed>), as loaded.
    sources: dict[str, str] = field(default_factory=dict)


class AdapterRegistry:
    """The desired adapter set per base model, and each replica's applied version.

    Args:
        configured: base model -> adapter name -> source, from the platform config (version 0, which
            every replica loads at start).
    """

    def __init__(self, configured: dict[str, dict[str, str]] | None = None) -> None:
        self._sets = {base: AdapterSet(0, dict(sources)) for base, sources in (configured or {}).items()}
        # The platform config's adapters as last given, to tell its changes from the admin API's.
        self._configured = {base: dict(sources) for base, sources in (configured or {}).items()}
        # replica id -> (base model, the version it last reported applied)
        self._applied: dict[str, tuple[str, int]] = {}

    def desired(self, base: str) -> AdapterSet:
        """The set every replica of ``base`` should serve."""
        return self._sets.get(base, AdapterSet())

    def bases(self) -> dict[str, str]:
        """Every registered adapter's name -> its base model."""
        return {name: base for base, adapters in self._sets.items() for name in adapters.sources}

    def apply(self, op: AdapterOp, base: str, name: str, source: str | None = None) -> AdapterSet:
        """Loads (or reloads) ``name`` from ``source`` under ``base``, or unloads it; returns the new set."""
        current = self.desired(base)
        sources = dict(current.sources)
        if op is AdapterOp.LOAD:
            sources[name] = source or ""
        else:
            sources.pop(name, None)
        self._sets[base] = AdapterSet(current.version + 1, sources)
        return self._sets[base]

    def reconcile(self, configured: dict[str, dict[str, str]]) -> dict[str, int]:
        """Applies a new platform config's adapters, keeping those loaded through the admin API.

        An adapter the config adds, or gives a new source, is loaded; one it drops is unloaded; a base model it
        no longer gives adapters loses its whole set. Adapters the config never named are left as they are.

        Returns:
            Each changed base model's new version (empty when nothing changed).
        """
        versions: dict[str, int] = {}
        for base in set(self._sets) - set(configured):
            del self._sets[base]
        for base, sources in configured.items():
            before = self._configured.get(base, {})
            current = dict(self.desired(base).sources)
            for name in set(before) - set(sources):
                current.pop(name, None)
            current.update({name: source for name, source in sources.items() if before.get(name) != source})
            if base not in self._sets or current != self._sets[base].sources:
                self._sets[base] = AdapterSet(self.desired(base).version + (base in self._sets), current)
                versions[base] = self._sets[base].version
        self._configured = {base: dict(sources) for base, sources in configured.items()}
        return versions

    def record_applied(self, replica_id: str, base: str, version: int) -> None:
        """Notes that a replica of ``base`` serves the set of ``version``."""
        self._applied[replica_id] = (base, version)

    def forget(self, replica_ids: Iterable[str]) -> None:
        """Drops replicas that are gone."""
        for replica_id in replica_ids:
            self._applied.pop(replica_id, None)

    def progress(self, base: str, version: int, live_replica_ids: Iterable[str]) -> tuple[int, int]:
        """(of ``base``'s live replicas, those that applied ``version`` or later; all of them)."""
        live = list(live_replica_ids)
        done = sum(1 for r in live if self._applied.get(r) is not None and self._applied[r][0] == base
                   and self._applied[r][1] >= version)
        return done, len(live)
