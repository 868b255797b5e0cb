"""Which engine requests the call a replica is running made, so the replica can report their progress.

A non-streamed response says nothing until it is whole, so the ingress, which aborts a request that goes
``progress_timeout_s`` without a new token, would abort a long answer that was making progress. The
replica sets a ``CallProgress`` in the call's context; the engine client under vLLM's app (which runs in
copies of that context) records each engine request the call makes; the replica sends a heartbeat while
the engine's token counts for them grow and its response has said nothing.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class CallProgress:
    """One API call's engine requests (several for ``n`` > 1 or a Responses call's turns)."""

    # vLLM's request ids, as its serving layer passed them to the engine client.
    request_ids: list[str] = field(default_factory=list)


# The call the current task runs for; None outside a replica's call.
CALL_PROGRESS: ContextVar[CallProgress | None] = ContextVar("fleetserve_call_progress", default=None)


def note_request(request_id: str) -> None:
    """Records an engine request for the call in this context, if any."""
    progress = CALL_PROGRESS.get()
    if progress is not None:
        progress.request_ids.append(request_id)
