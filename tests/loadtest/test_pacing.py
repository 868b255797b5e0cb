"""The load tester's pacer on a virtual clock: absolute send times, so late wake-ups never accumulate."""

import asyncio

import pytest

from fleetserve.loadtest.pacing import Pacer


class VirtualClock:
    """A clock whose sleeps overshoot by a fixed amount, as a busy event loop's do."""

    def __init__(self, overshoot_s: float = 0.0) -> None:
        self.now = 100.0
        self.overshoot_s = overshoot_s

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds + self.overshoot_s


def make_pacer(clock: VirtualClock) -> Pacer:
    return Pacer(asyncio.Event(), clock=clock.time, sleep=clock.sleep)


async def test_overshoot_does_not_accumulate_over_many_waits():
    clock = VirtualClock(overshoot_s=0.003)
    pacer = make_pacer(clock)
    sent_at = []
    for i in range(1, 101):
        assert await pacer.wait_until(i * 0.01)
        sent_at.append(pacer.elapsed())
    # Each send is 3 ms late, the 100th too; sleeping each gap in turn would make it 100 x 3 = 300 ms late.
    assert sent_at == pytest.approx([i * 0.01 + 0.003 for i in range(1, 101)], abs=1e-9)


async def test_a_stall_sends_what_fell_due_at_once_and_keeps_the_rest_on_schedule():
    clock = VirtualClock(overshoot_s=0.005)
    pacer = make_pacer(clock)
    sent_at = []
    for offset in [0.1, 0.2, 0.3, 0.4, 0.5]:
        assert await pacer.wait_until(offset)
        sent_at.append(pacer.elapsed())
        if offset == 0.2:
            clock.now += 0.25  # the loop is blocked for 250 ms after the second send
    # 0.1 + 5 ms; 0.2 + 5 ms; the stall ends at 0.205 + 0.25 = 0.455, after 0.3 and 0.4 fell due, so both
    # leave then; 0.5 is still ahead and leaves on time (+ 5 ms).
    assert sent_at == pytest.approx([0.105, 0.205, 0.455, 0.455, 0.505], abs=1e-9)


async def test_a_past_offset_returns_without_sleeping():
    clock = VirtualClock(overshoot_s=1.0)
    pacer = make_pacer(clock)
    clock.now += 2.0
    assert await pacer.wait_until(0.5)
    assert pacer.elapsed() == 2.0  # no sleep, so no 1 s overshoot


async def test_stop_ends_a_wait_in_progress():
    stop = asyncio.Event()
    pacer = Pacer(stop)
    asyncio.get_running_loop().call_later(0.01, stop.set)
    # An hour's wait returns as soon as the run is stopped, and says it was.
    assert await asyncio.wait_for(pacer.wait_until(3600.0), timeout=30) is False
