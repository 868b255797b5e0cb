"""Start-time fair queuing by tenant weight: the order in which a model's engines start admitted requests.

Each request gets a start tag: the later of the model's virtual time and where its tenant's previous request
ends, a request costing 1 / share. Lower tags start first (vLLM's ``priority`` on priority-scheduled engines,
and the order in which ``SlotGate`` sends held requests). A flood's tags run ahead of the virtual time, so a
light tenant's request, tagged at about the virtual time, goes before the flood's backlog; and since a tag
never changes, the flood's own requests start in arrival order. Ranking a request by its tenant's requests in
flight instead starved some of the flood's for over 30 s: later ones, sent while fewer were in flight, kept
ranking ahead of them (docs/benchmarks.md).
"""

from __future__ import annotations

# Tags are fractional; vLLM's priorities are integers: a tag of 1 is this many priority steps.
PRIORITY_STEPS = 1000
# Added to a batch tenant's priorities (lower is scheduled first): beyond any interactive tag, so all
# interactive work runs first.
BATCH_PRIORITY = 10**18


class FairQueue:
    """Start tags per model and tenant (one ingress replica's view)."""

    def __init__(self) -> None:
        # Per model: the largest tag of a request its engines have started (the virtual time).
        self.virtual_time: dict[str, float] = {}
        # Per (model, tenant): where the tenant's last tagged request ends.
        self._finish: dict[tuple[str, str], float] = {}

    def tag(self, model: str, tenant: str, share: float) -> float:
        """The start tag of a new request of ``tenant`` (its weighted ``share``, 0-1) to ``model``."""
        start = max(self.virtual_time.get(model, 0.0), self._finish.get((model, tenant), 0.0))
        self._finish[model, tenant] = start + 1.0 / share
        return start

    def started(self, model: str, tag: float) -> None:
        """An engine has started the request tagged ``tag`` (its first chunk came): virtual time moves on."""
        self.virtual_time[model] = max(self.virtual_time.get(model, 0.0), tag)


def priority(tag: float, batch: bool) -> int:
    """vLLM's request priority for a request's start tag and class."""
    return round(tag * PRIORITY_STEPS) + (BATCH_PRIORITY if batch else 0)
