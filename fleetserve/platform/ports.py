"""TCP ports on this node: whether one can be bound, and a free one."""

from __future__ import annotations

import socket


def bindable(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (SO_REUSEADDR, as servers bind: a port left in TIME_WAIT counts
    as free, one another socket listens on does not)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str) -> int:
    """A port free on ``host`` when asked (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
