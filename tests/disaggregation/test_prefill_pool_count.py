"""The decode server's view of its prefill pool: Serve's RUNNING replicas, cached, and unknown when Serve's
status cannot be read."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from factories import RecordingHandle
from fleetserve.deployments.disaggregated import decode_server
from fleetserve.deployments.disaggregated.decode_server import HandlePrefillClient


def status_with(replica_states: dict[str, int], app: str = "fleetserve", deployment: str = "prefill-pd"):
    deployments = {deployment: SimpleNamespace(replica_states=replica_states)}
    return SimpleNamespace(applications={app: SimpleNamespace(deployments=deployments)})


def client() -> HandlePrefillClient:
    return HandlePrefillClient(RecordingHandle(app_name="fleetserve", deployment_name="prefill-pd"))


class StatusCalls:
    """serve.status stand-in: returns (or raises) what it is given and counts its calls."""

    def __init__(self, result) -> None:
        self.result, self.num_calls = result, 0

    def __call__(self):
        self.num_calls += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def count(pool: HandlePrefillClient) -> int | None:
    return asyncio.run(pool.num_running_replicas())


def test_running_replicas_are_those_serve_reports_running(monkeypatch):
    monkeypatch.setattr(decode_server.serve, "status", StatusCalls(status_with({"RUNNING": 2, "STARTING": 1})))
    assert count(client()) == 2


@pytest.mark.parametrize("status", [
    status_with({"RUNNING": 1}, app="other"),             # the app is gone
    status_with({"RUNNING": 1}, deployment="other"),      # the deployment is gone
    RuntimeError("controller unreachable"),               # Serve's status cannot be read
])
def test_running_replicas_are_unknown_when_serve_cannot_say(monkeypatch, status):
    monkeypatch.setattr(decode_server.serve, "status", StatusCalls(status))
    assert count(client()) is None


def test_a_pool_with_no_running_replica_counts_zero(monkeypatch):
    monkeypatch.setattr(decode_server.serve, "status", StatusCalls(status_with({"STARTING": 1})))
    assert count(client()) == 0


def test_running_replicas_are_looked_up_once_per_check_period(monkeypatch):
    calls = StatusCalls(status_with({"RUNNING": 1}))
    monkeypatch.setattr(decode_server.serve, "status", calls)
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(decode_server.time, "monotonic", lambda: clock.now)
    pool = client()
    assert [count(pool), count(pool)] == [1, 1] and calls.num_calls == 1
    calls.result = status_with({"RUNNING": 0})
    clock.now += decode_server.POOL_CHECK_PERIOD_S
    assert count(pool) == 0 and calls.num_calls == 2
