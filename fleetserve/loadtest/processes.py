"""Resource readings of the local processes serving a benchmark (Ray workers are found by their titles)."""

from __future__ import annotations

import psutil


def resident_bytes(title: str) -> int:
    """Resident memory of every process whose command line contains ``title`` (Ray names a Serve replica's
    worker ``ray::ServeReplica:<app>:<deployment>``), with all their children (a replica's vLLM engine)."""
    total = 0
    for process in psutil.process_iter(["cmdline"]):
        if title in " ".join(process.info["cmdline"] or []):
            for member in [process, *process.children(recursive=True)]:
                try:
                    total += member.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
    return total
