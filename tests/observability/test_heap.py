"""The heap tracker the ingress uses for memory investigations: object gains by type, allocation sites."""

import sys
import tracemalloc

import memray

from fleetserve.deployments.ingress.heap import MEMRAY_ENV, TRACEMALLOC_ENV, HeapTracker, start_tracing_if_asked


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


def test_native_capture_holds_what_was_allocated_and_kept_after_the_mark(monkeypatch, tmp_path):
    monkeypatch.setenv(MEMRAY_ENV, str(tmp_path / "native.bin"))
    before = bytearray(5 * 2**20)  # allocated before the mark: not recorded
    tracker = HeapTracker()
    tracker.mark()
    kept = bytearray(3 * 2**20 + 6)
    gone = bytearray(2**21)
    del gone  # allocated and freed after the mark: not live at the end
    growth = tracker.growth()
    assert growth.native_capture == str(tmp_path / "native.bin")
    sizes = [record.size for record in memray.FileReader(growth.native_capture).get_leaked_allocation_records()]
    # A bytearray's buffer is one malloc of its length plus a NUL: 3 MiB + 6 + 1.
    assert 3 * 2**20 + 7 in sizes and 5 * 2**20 + 1 not in sizes and 2**21 + 1 not in sizes
    assert len(before) + len(kept) == 8 * 2**20 + 6


def test_native_capture_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(MEMRAY_ENV, raising=False)
    tracker = HeapTracker()
    tracker.mark()
    assert tracker.growth().native_capture == ""
