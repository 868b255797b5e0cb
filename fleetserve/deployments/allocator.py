"""Keeps a Serve replica's resident memory at its load, not at its busiest moment so far.

Ray runs each task of an async actor (every request a Serve replica handles) on a boost fiber whose stack
is one 256 KiB ``malloc``. glibc serves a block that size with ``mmap`` only until the first one is freed;
then it raises its mmap threshold above it, and later stacks come from a malloc arena. Memory freed inside
an arena stays resident: glibc gives back only the arena's top. Measured with memray on the ingress under a
2x overload: 364 stacks live at once (91 MiB), and RSS held at that peak after they were freed.

Two remedies, both glibc's own: pinning the mmap threshold keeps every stack an ``mmap`` of its own,
returned to the kernel when its request ends; ``malloc_trim`` now and then returns the free pages inside the
arenas (the task records, protobufs and Python objects a burst leaves behind).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

# Set to 0 to leave glibc's allocator as it is (benchmarks/fiber_memory.py's "before").
TUNE_ENV = "FLEETSERVE_TUNE_MALLOC"
# glibc's mallopt parameter number for the mmap threshold (malloc.h).
M_MMAP_THRESHOLD = -3
# glibc's default threshold; setting it also stops glibc from raising it (and the trim threshold) later.
MMAP_THRESHOLD_BYTES = 128 * 1024
# How often free arena pages go back to the kernel. A trim walks every arena (a few ms under their locks);
# twice a minute costs nothing measurable and bounds how long a burst's memory stays resident.
TRIM_INTERVAL_S = 30.0


@functools.cache
def _load_glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both exist only in glibc
    except (OSError, AttributeError):
        logger.info("not glibc: the allocator is left as it is")
        return None
    return libc


def _glibc() -> ctypes.CDLL | None:
    return None if os.environ.get(TUNE_ENV) == "0" else _load_glibc()


def pin_mmap_threshold(num_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Makes every allocation of ``num_bytes`` or more its own mmap, for the rest of this process.

    Returns:
        Whether it took effect: False where the C library is not glibc, or FLEETSERVE_TUNE_MALLOC is 0.
    """
    libc = _glibc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, num_bytes) == 1


def trim_free_memory() -> bool:
    """Returns free pages inside glibc's arenas to the kernel.

    Returns:
        Whether any memory went back: False also where the C library is not glibc, or tuning is off.
    """
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Trims every ``interval_s`` for as long as the task runs (a replica's lifetime)."""
    while True:
        await asyncio.sleep(interval_s)
        trim_free_memory()


def tune_for_serving(loop: asyncio.AbstractEventLoop,
                     trim_interval_s: float = TRIM_INTERVAL_S) -> asyncio.Task | None:
    """Pins the mmap threshold and starts the periodic trim on ``loop``; None where glibc is not tunable."""
    if not pin_mmap_threshold():
        return None
    return loop.create_task(trim_periodically(trim_interval_s))
