"""Telling a hung engine from an idle one (``fleetserve.platform.stall``), and the replica health check built on it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from fleetserve.platform.config import ModelConfig
from fleetserve.platform.stall import EngineStalledError, StallWatch


def test_an_idle_engine_never_stalls_however_old_its_last_step():
    watch = StallWatch(stall_timeout_s=60, idle_at=0.0)
    assert watch.stalled_for(num_unfinished=0, last_step_at=0.0, now=10_000.0) == 0.0
    watch.check(num_unfinished=0, last_step_at=0.0, now=10_000.0)


def test_a_stall_counts_from_the_later_of_the_last_step_and_the_last_idle_sight():
    watch = StallWatch(stall_timeout_s=60, idle_at=0.0)
    watch.stalled_for(num_unfinished=0, last_step_at=0.0, now=1_000.0)  # idle at 1000 (last step long before)
    # Busy since: no step after 1000, so stalled for 1050 - 1000 = 50 s, not 1050 s since the step at 0.
    assert watch.stalled_for(num_unfinished=3, last_step_at=0.0, now=1_050.0) == 50.0
    # A step at 1040 restarts the count: 1090 - 1040 = 50 s.
    assert watch.stalled_for(num_unfinished=3, last_step_at=1_040.0, now=1_090.0) == 50.0
    watch.check(num_unfinished=3, last_step_at=1_040.0, now=1_100.0)  # 60 s: not yet longer than 60
    with pytest.raises(EngineStalledError, match=r"holds 3 unfinished request\(s\) and has finished no step for 61 s "
                                                 r"\(stall_timeout_s=60\)"):
        watch.check(num_unfinished=3, last_step_at=1_040.0, now=1_101.0)


async def test_replica_health_check_fails_once_its_engine_stalls(fake_engine_cls, monkeypatch):
    from fleetserve.deployments import engine_server
    from fleetserve.deployments.engine_server import EngineServer
    from fleetserve.platform.api_types import ApiRequest, Endpoint

    class Hung(fake_engine_cls):
        first_token_s = 30.0  # the request never gets a step in this test

    # The replica's clock, set by the test: a loaded machine's pauses must not read as a stall.
    now = [1_000.0]
    monkeypatch.setattr(engine_server, "time", SimpleNamespace(time=lambda: now[0]))
    server = EngineServer(ModelConfig(name="fake", source="unused", stall_timeout_s=0.2), engine_cls=Hung,
                          model_path="/unused")
    await server.check_health()  # idle: healthy, and seen idle at 1000
    stream = server.forward(ApiRequest("stuck", Endpoint.COMPLETIONS, b'{"model": "fake", "prompt": "a"}'))
    pending = asyncio.ensure_future(anext(stream))
    while server.engine.num_unfinished_requests == 0:
        await asyncio.sleep(0.01)
    now[0] = 1_000.1
    await server.check_health()  # busy since 1000 with no step: 0.1 s, within stall_timeout_s
    now[0] = 1_000.3  # 0.3 s: longer than stall_timeout_s
    with pytest.raises(EngineStalledError):
        await server.check_health()
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    await stream.aclose()


async def test_no_stall_timeout_means_no_stall_check(fake_engine_cls):
    from fleetserve.deployments.engine_server import EngineServer

    server = EngineServer(ModelConfig(name="fake", source="unused", stall_timeout_s=None), engine_cls=fake_engine_cls,
                          model_path="/unused")
    server.engine.running.add("held")  # unfinished, with no step ever
    await asyncio.sleep(0.05)
    await server.check_health()
