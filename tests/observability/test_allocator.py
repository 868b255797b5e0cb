"""glibc tuning for serving processes: fiber-sized blocks stay mmaps of their own, and a trim returns the
free pages a burst leaves inside malloc's arenas."""

import asyncio
import os
import subprocess
import sys
import textwrap

from fleetserve.deployments import allocator
from fleetserve.deployments.allocator import TUNE_ENV

# A child process, so the tuning does not change this test process's allocator. It mallocs and frees one
# fiber-sized block (glibc's dynamic threshold rises above it), then holds three more and reports how many
# of them are mmaps (mallinfo2's hblks).
MMAP_PROBE = textwrap.dedent("""
    import ctypes, sys
    from fleetserve.deployments.allocator import pin_mmap_threshold

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "pin":
        print(pin_mmap_threshold())
    libc.free(libc.malloc(256 * 1024))
    before = libc.mallinfo2().hblks
    held = [libc.malloc(256 * 1024) for _ in range(3)]
    print(libc.mallinfo2().hblks - before)
""")

# 40,000 blocks of 1 KiB (about 40 MiB of arena) are written and freed, all but the last, which keeps glibc
# from giving the arena's top back by itself. Reports resident KiB after the frees and after a trim.
TRIM_PROBE = textwrap.dedent("""
    import ctypes
    import psutil
    from fleetserve.deployments.allocator import trim_free_memory

    def rss_kib():
        return psutil.Process().memory_info().rss // 1024

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(1024) for _ in range(40_000)]
    for block in blocks:
        ctypes.memset(block, 1, 1024)
    for block in blocks[:-1]:
        libc.free(block)
    freed = rss_kib()
    trimmed = trim_free_memory()
    print(trimmed, freed, rss_kib())
""")


def run_probe(probe: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **(env or {})})
    return done.stdout.split()


def test_fiber_sized_blocks_are_mmaps_after_the_pin():
    assert run_probe(MMAP_PROBE, "pin") == ["True", "3"]


def test_fiber_sized_blocks_come_from_the_arena_without_the_pin():
    # glibc's default: the first free raised the threshold, so none of the three is an mmap.
    assert run_probe(MMAP_PROBE, "none") == ["0"]


def test_pin_is_skipped_when_tuning_is_off():
    assert run_probe(MMAP_PROBE, "pin", env={TUNE_ENV: "0"}) == ["False", "0"]


def test_trim_returns_the_freed_arena_pages():
    trimmed, freed_kib, trimmed_kib = run_probe(TRIM_PROBE)
    # 39,999 freed blocks of 1 KiB (+16 bytes of header each): ~40 MiB free inside the arena. At least
    # 30 MiB of it must leave RSS (pages shared with the kept block and the allocator's own stay).
    assert trimmed == "True" and int(freed_kib) - int(trimmed_kib) >= 30 * 1024


def test_trim_keeps_the_pages_when_tuning_is_off():
    trimmed, freed_kib, trimmed_kib = run_probe(TRIM_PROBE, env={TUNE_ENV: "0"})
    assert trimmed == "False" and int(freed_kib) - int(trimmed_kib) < 1024


def test_periodic_trim_runs_every_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "trim_free_memory", lambda: calls.append(1))

    async def run_for_three_intervals():
        task = asyncio.get_running_loop().create_task(allocator.trim_periodically(0.01))
        while len(calls) < 3:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(asyncio.wait_for(run_for_three_intervals(), timeout=10))
    assert len(calls) == 3
