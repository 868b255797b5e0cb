"""The load tester's HTTP connections, spread over several pools.

httpcore's connection pool (1.0) re-examines every connection it holds each time a request joins or leaves it,
and for each idle connection counts them all again: work that grows with the square of the connections held.
Against an overloaded server that holds a thousand requests, one pool took the client's whole core and sent
on a schedule it could no longer keep (docs/benchmarks.md). Several pools, each with a share of the
connections, keep that work small.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx

# Pools per run: at a thousand connections in flight each holds ~60, whose squared work is ~1/256 of one pool's.
NUM_POOLS = 16


class ConnectionPools:
    """Several ``httpx.AsyncClient`` with the same options; requests take them in turn."""

    def __init__(self, num_pools: int = NUM_POOLS, **client_options: Any) -> None:
        if num_pools < 1:
            raise ValueError(f"num_pools must be at least 1, got {num_pools}")
        self.clients = [httpx.AsyncClient(**client_options) for _ in range(num_pools)]
        self._turns = itertools.cycle(self.clients)

    @property
    def first(self) -> httpx.AsyncClient:
        """The pool for requests outside the schedule (the preflight, warm-ups)."""
        return self.clients[0]

    def next(self) -> httpx.AsyncClient:
        """The pool for the next scheduled request."""
        return next(self._turns)

    async def __aenter__(self) -> ConnectionPools:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for client in self.clients:
            await client.aclose()
