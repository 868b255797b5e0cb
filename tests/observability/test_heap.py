"""The heap tracker the ingress uses for memory investigations: object gains by type, allocation sites."""

import sys
import tracemalloc

from fleetserve.deployments.ingress.heap import TRACEMALLOC_ENV, HeapTracker, start_tracing_if_asked


class Held:
    """Objects a test keeps alive after the mark."""


def test_growth_counts_objects_gained_since_the_mark_by_type():
    tracker = HeapTracker()
    before = [Held() for _ in range(5)]
    tracker.mark()
    after = [Held() for _ in range(37)]
    del before  # objects freed after the mark lower the gain: 37 new - 5 freed = 32
    gains = dict(tracker.growth(limit=1000).object_gains)
    assert gains["Held"] == 32
    assert tracker.growth().site_gains == [] and len(after) == 37  # no tracemalloc: no sites


def test_growth_names_the_allocation_site_under_tracemalloc():
    tracemalloc.start(1)
    try:
        tracker = HeapTracker()
        tracker.mark()
        block = bytearray(2**20)  # the largest allocation since the mark, by far
        growth = tracker.growth(limit=3)
    finally:
        tracemalloc.stop()
    site, num_bytes, num_blocks = growth.site_gains[0]
    # Two blocks: the bytearray object and its buffer (2**20 bytes and a NUL), together its getsizeof.
    assert site.endswith(f"test_heap.py:{block_line()}") and (num_bytes, num_blocks) == (sys.getsizeof(block), 2)
    assert growth.traced_bytes >= 2**20 and len(block) == 2**20


def block_line() -> int:
    source = open(__file__).read().splitlines()
    return next(number for number, line in enumerate(source, 1) if "block = bytearray(2**20)" in line)


def test_tracing_starts_only_when_asked(monkeypatch):
    monkeypatch.delenv(TRACEMALLOC_ENV, raising=False)
    assert start_tracing_if_asked() is False
    monkeypatch.setenv(TRACEMALLOC_ENV, "4")
    try:
        assert start_tracing_if_asked() is True and tracemalloc.get_traceback_limit() == 4
    finally:
        tracemalloc.stop()
