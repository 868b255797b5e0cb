"""Engine slots held free for requests on the fair schedule.

vLLM orders its waiting queue by priority but never preempts a running request for a waiting one while its
``max_num_seqs`` slots are full (it preempts only when KV runs out). So once a flood fills every slot, a light
tenant's request waits for one of the flood's to finish, however early its priority puts it in the queue.
``SlotGate`` keeps the last ``limits.num_reserved_slots`` of a model's slots for interactive requests on the
fair schedule: those whose fair-queuing start tag (``FairQueue``) is not past the model's virtual time. A
flood's tags run ahead of the virtual time, so its requests keep to the open slots and wait here for one,
while a light tenant's request, tagged at the virtual time, is sent at once into a reserved slot. Batch work
never takes one. Reserved slots stand idle while no request on the schedule uses them: that is the price of
starting such a request at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetserve.deployments.ingress.admission import TenantClass


@dataclass(order=True)
class _Waiter:
    """A request held for a slot; waiters are sent in this order (interactive first, then by start tag)."""

    batch: bool
    tag: float
    # Arrival order, to break ties.
    seq: int
    claim: TenantClass = field(compare=False)
    future: asyncio.Future = field(compare=False)


class SlotGate:
    """Holds requests off a model's reserved engine slots unless they are on the fair schedule.

    Counts the requests this ingress has sent to the model's engines and not finished.

    Args:
        num_reserved: slots kept for requests on the schedule (``limits.num_reserved_slots``).
        num_slots: the model's slots: ``max_num_seqs`` x serving replicas (``resize`` keeps it current).
        virtual_time: the model's fair-queuing virtual time (``FairQueue``); call ``wake`` when it moves.
    """

    def __init__(self, num_reserved: int, num_slots: int, virtual_time: Callable[[], float]) -> None:
        self.num_reserved = num_reserved
        self.num_slots = num_slots
        self.virtual_time = virtual_time
        self.num_sent = 0
        self.sent_by_tenant: Counter[str] = Counter()
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def num_held(self) -> int:
        """Requests waiting here for a slot."""
        return len(self._waiters)

    def may_send(self, claim: TenantClass) -> bool:
        """Whether the request may go to the engines now: into an open slot, or, when interactive and on the
        fair schedule (its tag not past the virtual time), into a reserved one."""
        # One slot stays open to all, however far replicas have scaled in.
        if self.num_sent + 1 <= self.num_slots - min(self.num_reserved, self.num_slots - 1):
            return True
        return not claim.batch and claim.tag <= self.virtual_time()

    def resize(self, num_slots: int) -> None:
        """Takes the model's current slot count (replicas come and go), and sends whom it now allows."""
        self.num_slots = num_slots
        self.wake()

    async def enter(self, claim: TenantClass) -> None:
        """Returns once the request may go to the engines, counted as sent; ``leave`` must follow.

        Raises:
            asyncio.CancelledError: cancelled while held (a timeout, a client gone); it holds no slot then.
        """
        if not self.try_enter(claim):
            await self.hold(claim)

    def try_enter(self, claim: TenantClass) -> bool:
        """Counts the request as sent if it may go now; ``leave`` must follow. False: ``hold`` it."""
        if self.may_send(claim):
            self._count(claim.tenant, 1)
            return True
        return False

    async def hold(self, claim: TenantClass) -> None:
        """Holds a request ``try_enter`` refused until it may go, counted as sent then (``enter``'s Raises)."""
        waiter = _Waiter(claim.batch, claim.tag, next(self._seq), claim, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(claim.tenant)  # sent in the same instant it was cancelled: give the slot back
            else:
                self._waiters.remove(waiter)
            raise

    def leave(self, tenant: str) -> None:
        """A sent request has finished: its slot may go to a held request."""
        self._count(tenant, -1)
        self.wake()

    def wake(self) -> None:
        """Sends the held requests that may go now (after a slot frees or the virtual time moves), in order."""
        for waiter in sorted(self._waiters):
            # A cancelled waiter's own task drops it when it resumes.
            if not waiter.future.done() and self.may_send(waiter.claim):
                self._waiters.remove(waiter)
                self._count(waiter.claim.tenant, 1)
                waiter.future.set_result(None)

    def _count(self, tenant: str, delta: int) -> None:
        self.num_sent += delta
        self.sent_by_tenant[tenant] += delta
