"""Removes shared-memory segments that vLLM workers left behind.

A vLLM CPU worker killed before it unlinks its ``/dev/shm/psm_*`` segment leaks ~160 MiB each time.
A segment that no live process has mapped or open is garbage: nothing can attach to it again.
"""

from __future__ import annotations

import os
from pathlib import Path

_SHM = Path("/dev/shm")
_PREFIXES = ("psm_",)


def _segments_in_use() -> set[str]:
    in_use: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    in_use.add(line.rsplit("/dev/shm/", 1)[1].split(" ")[0])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    in_use.add(target[len("/dev/shm/"):])
        except OSError:  # process exited or is not ours to read
            continue
    return in_use


def remove_orphaned_segments() -> list[str]:
    """Deletes vLLM's shared-memory segments that no process uses; returns the names removed."""
    if not _SHM.is_dir():
        return []
    candidates = [path for path in _SHM.iterdir() if path.name.startswith(_PREFIXES)]
    if not candidates:
        return []
    in_use = _segments_in_use()
    removed = []
    for path in candidates:
        if path.name not in in_use:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed
