"""Replica-routing decisions, shared between the Serve request router and the ingress in one process.

This lives apart from ``serve_adapter``: Ray Serve cloudpickles the router's own module by value, so
state kept there would be a private copy. Modules it imports are pickled by reference, so this one is shared.
"""

from __future__ import annotations

from collections import OrderedDict

from fleetserve.router.replica.policy import RoutingDecision

_MAX_RECENT = 10_000
# Recent decisions by fleetserve request id; the ingress pops them for response headers.
recent: OrderedDict[str, RoutingDecision] = OrderedDict()


def record(request_id: str | None, decision: RoutingDecision) -> None:
    if request_id is None:
        return
    recent[request_id] = decision
    while len(recent) > _MAX_RECENT:
        recent.popitem(last=False)


def pop(request_id: str) -> RoutingDecision | None:
    return recent.pop(request_id, None)
