"""Sending on schedule: each request waits for its absolute send time, so one late wake-up (a GC pause, a
starved core) delays only the requests already due, never the ones after them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable


class Pacer:
    """Waits until offsets measured from one start, unless the run is stopped first.

    Args:
        stop: set to end the run; a wait in progress returns at once.
        clock: seconds, monotonic; the start is its reading at construction.
        sleep: sleeps about the seconds given (tests inject a virtual one); by default it returns early
            when ``stop`` is set.
    """

    def __init__(self, stop: asyncio.Event, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        self.stop = stop
        self.clock = clock
        self.sleep = sleep or self._sleep_unless_stopped
        self.start = clock()

    async def wait_until(self, offset_s: float) -> bool:
        """Returns at ``start + offset_s`` (or at once if that has passed); False if the run was stopped."""
        wait = self.start + offset_s - self.clock()
        if wait > 0:
            await self.sleep(wait)
        return not self.stop.is_set()

    def elapsed(self) -> float:
        """Seconds since the start."""
        return self.clock() - self.start

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)
