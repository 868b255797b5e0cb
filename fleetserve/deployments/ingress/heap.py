"""What a process's Python heap gained since a mark: for finding memory growth under load.

Object counts by type are always available (the garbage collector's view). Allocation sites need
tracemalloc, which costs CPU on every allocation, so it runs only when FLEETSERVE_TRACEMALLOC names a
traceback depth (``benchmarks/overload.py --memory --tracemalloc`` sets it for the ingress). Native
allocations (C and C++ libraries: Ray's core worker, gRPC, the allocator itself) are invisible to both; when
FLEETSERVE_MEMRAY names a file, memray (in the dev extra, not a runtime dependency) records them, with
native stacks, from the mark to the growth report (``benchmarks/overload.py --memory --memray``).
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field

# Frames kept per allocation when set (e.g. 8); unset or 0: tracemalloc stays off.
TRACEMALLOC_ENV = "FLEETSERVE_TRACEMALLOC"
# A memray capture file to write between the mark and the growth report; unset: no native tracing.
MEMRAY_ENV = "FLEETSERVE_MEMRAY"


def start_tracing_if_asked() -> bool:
    """Starts tracemalloc when FLEETSERVE_TRACEMALLOC asks for it; whether it traces now."""
    frames = int(os.environ.get(TRACEMALLOC_ENV) or 0)
    if frames > 0 and not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    return tracemalloc.is_tracing()


def object_counts() -> Counter[str]:
    """Live objects the garbage collector tracks, by type name."""
    return Counter(type(obj).__qualname__ for obj in gc.get_objects())


@dataclass
class HeapGrowth:
    """What the heap gained between a mark and now."""

    # (type name, objects gained), largest gain first.
    object_gains: list[tuple[str, int]] = field(default_factory=list)
    # (allocation site "file:line", bytes gained, blocks gained), largest first; empty without tracemalloc.
    site_gains: list[tuple[str, int, int]] = field(default_factory=list)
    # Bytes tracemalloc sees allocated now and at its peak; 0 without it.
    traced_bytes: int = 0
    traced_peak_bytes: int = 0
    # The memray capture of native allocations since the mark; "" without FLEETSERVE_MEMRAY.
    native_capture: str = ""


class HeapTracker:
    """Marks the heap, then reports what it gained since."""

    def __init__(self) -> None:
        self._counts: Counter[str] | None = None
        self._snapshot: tracemalloc.Snapshot | None = None
        self._native = None

    def mark(self) -> None:
        """Takes the baseline (after a full collection, so garbage is not counted)."""
        gc.collect()
        self._counts = object_counts()
        self._snapshot = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
        self._start_native()

    def _start_native(self) -> None:
        path = os.environ.get(MEMRAY_ENV)
        if not path or self._native is not None:
            return
        import memray

        # Aggregated: every allocation counted, but the file holds only what is live and where it came from.
        self._native = memray.Tracker(path, native_traces=True, follow_fork=False,
                                      file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)
        self._native.__enter__()

    def _stop_native(self) -> str:
        if self._native is None:
            return ""
        self._native.__exit__(None, None, None)
        self._native = None
        return os.environ[MEMRAY_ENV]

    def growth(self, limit: int = 20) -> HeapGrowth:
        """The ``limit`` largest gains since the mark (since nothing, before one)."""
        native_capture = self._stop_native()
        gc.collect()
        counts = object_counts()
        counts.subtract(self._counts or Counter())
        gains = [(name, num) for name, num in counts.most_common(limit) if num > 0]
        if not tracemalloc.is_tracing():
            return HeapGrowth(object_gains=gains, native_capture=native_capture)
        snapshot = tracemalloc.take_snapshot()
        stats = (snapshot.compare_to(self._snapshot, "traceback") if self._snapshot is not None
                 else snapshot.statistics("traceback"))
        sites = [(" <- ".join(f"{frame.filename}:{frame.lineno}" for frame in stat.traceback),
                  getattr(stat, "size_diff", stat.size), getattr(stat, "count_diff", stat.count))
                 for stat in stats[:limit]]
        current, peak = tracemalloc.get_traced_memory()
        return HeapGrowth(object_gains=gains, site_gains=sites, traced_bytes=current, traced_peak_bytes=peak,
                          native_capture=native_capture)
