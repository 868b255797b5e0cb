"""Servers started on this machine, for tests and benchmarks: a free port, and waiting until one answers."""

from __future__ import annotations

import socket
import time

import httpx


def free_port() -> int:
    """A free TCP port on loopback, for servers started locally."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_ready(base_url: str, timeout_s: float = 600.0, process=None, poll_s: float = 0.5) -> None:
    """Polls ``/health`` every ``poll_s`` until the server answers.

    Raises:
        RuntimeError: the server exited or did not answer in time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{base_url} was not ready after {timeout_s:.0f} s")
