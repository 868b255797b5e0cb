"""Engine slots reserved for requests on the fair schedule (limits.num_reserved_slots): the gate's arithmetic
exactly, then through the ingress on a fake engine whose first token takes 1 s, so every sent request holds
its slot while the rest arrive."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tenant_ingress import KEYS, tenant_ingress

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.fair_queue import FairQueue
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.deployments.ingress.admission import TenantClass
from fleetserve.deployments.ingress.slots import SlotGate
from fleetserve.platform.config import LimitsConfig, ModelConfig, parse_config
from fleetserve.platform.config.base import ConfigError

SHARES = {"heavy": 0.75, "light": 0.25}


class Fixture:
    """A model's fair queue and its slot gate (4 slots, 1 reserved by default)."""

    def __init__(self, num_reserved: int = 1, num_slots: int = 4) -> None:
        self.fair = FairQueue()
        self.gate = SlotGate(num_reserved, num_slots, lambda: self.fair.virtual_time.get("m", 0.0))

    def claims(self, *tenants: str, shares: dict[str, float] = SHARES, batch: bool = False) -> list[TenantClass]:
        """One tagged request per name, in order."""
        return [TenantClass(name, shares[name], batch, self.fair.tag("m", name, shares[name])) for name in tenants]

    async def enter_all(self, claims: list[TenantClass]) -> list[asyncio.Task]:
        """Starts one entry per claim, in order, and lets each either enter or start waiting."""
        tasks = []
        for claim in claims:
            tasks.append(asyncio.ensure_future(self.gate.enter(claim)))
            await asyncio.sleep(0)
        return tasks


async def test_a_flood_ahead_of_the_schedule_leaves_the_reserved_slot_free():
    f = Fixture()
    tasks = await f.enter_all(f.claims(*["heavy"] * 4, "light", "light"))
    # Nothing has started, so the virtual time is 0. heavy's tags: 0, 4/3, 8/3, 4 (each costs 1 / 0.75); light's:
    # 0, 4. The 3 open slots go to heavy's first three; heavy's 4th (tag 4 > 0) would take the reserved one:
    # held. light's 1st (tag 0) is on the schedule: sent. light's 2nd (tag 4): held.
    assert [task.done() for task in tasks] == [True, True, True, False, True, False]
    assert (f.gate.num_sent, f.gate.num_held) == (4, 2)
    assert f.gate.sent_by_tenant == {"heavy": 3, "light": 1}


async def test_a_held_request_goes_once_the_virtual_time_reaches_its_tag():
    f = Fixture()
    claims = f.claims(*["heavy"] * 4, "light", "light")
    tasks = await f.enter_all(claims)
    f.fair.started("m", claims[2].tag)  # heavy's 3rd started: the virtual time is 8/3, short of both held tags (4)
    f.gate.wake()
    assert f.gate.num_held == 2
    f.fair.started("m", claims[5].tag)
    f.gate.wake()
    await asyncio.sleep(0)
    # The virtual time is 4: both held requests are on the schedule, and both are sent though no slot freed
    # (the engine queues what its slots cannot run, by priority).
    assert all(task.done() for task in tasks)
    assert f.gate.num_sent == 6


async def test_a_freed_open_slot_goes_to_the_lowest_tag():
    f = Fixture()
    tasks = await f.enter_all(f.claims(*["heavy"] * 5, "light", "light"))
    # Sent: heavy's first three and light's first; held: heavy's 4th (tag 4) and 5th (16/3), light's 2nd (4).
    assert [task.done() for task in tasks] == [True, True, True, False, False, True, False]
    f.gate.leave("heavy")
    f.gate.leave("light")
    await asyncio.sleep(0)
    # 2 sent: one open slot, for the lowest tag, 4, of the earlier arrival: heavy's 4th.
    assert [task.done() for task in tasks] == [True, True, True, True, False, True, False]
    f.gate.leave("heavy")
    await asyncio.sleep(0)
    # The next open slot: light's 2nd (tag 4) goes before heavy's 5th (16/3), though it came later.
    assert [task.done() for task in tasks] == [True, True, True, True, False, True, True]


async def test_held_requests_go_in_fair_queuing_order():
    f = Fixture()
    shares = {"early": 0.5, "late": 0.5}
    tasks = await f.enter_all(f.claims(*["early"] * 4, shares=shares, batch=True)
                              + f.claims("late", shares=shares, batch=True))
    # Batch work fills only the 3 open slots: early's 4th (tag 6) and late's 1st (tag 0) are held.
    assert [task.done() for task in tasks] == [True, True, True, False, False]
    f.gate.leave("early")
    await asyncio.sleep(0)
    # One open slot: the lower tag takes it, though it came last; early's stays held (3 sent again).
    assert [task.done() for task in tasks] == [True, True, True, False, True]
    assert f.gate.sent_by_tenant == {"early": 2, "late": 1}


async def test_batch_work_never_takes_a_reserved_slot():
    f = Fixture()
    tasks = await f.enter_all(f.claims(*["nightly"] * 4, shares={"nightly": 1.0}, batch=True))
    f.fair.started("m", 10.0)
    f.gate.wake()
    await asyncio.sleep(0)
    # All four are on the schedule (tags 0-3, virtual time 10), yet batch work fills only the 3 open slots.
    assert [task.done() for task in tasks] == [True, True, True, False]


async def test_one_slot_stays_open_however_far_replicas_scale_in():
    f = Fixture(num_reserved=4, num_slots=4)
    tasks = await f.enter_all(f.claims("nightly", "nightly", shares={"nightly": 1.0}, batch=True))
    # A reserve of 4 of 4 slots leaves min(4, 4 - 1) = 3 reserved: one open.
    assert [task.done() for task in tasks] == [True, False]
    f.gate.resize(8)
    await asyncio.sleep(0)
    # 8 slots, 4 reserved: 4 open.
    assert tasks[1].done()


async def test_a_held_request_cancelled_holds_nothing():
    f = Fixture()
    tasks = await f.enter_all(f.claims(*["heavy"] * 4))
    tasks[3].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[3]
    assert (f.gate.num_sent, f.gate.num_held) == (3, 0)
    f.gate.leave("heavy")
    assert f.gate.num_sent == 2


def reserved_ingress(engine_cls) -> tuple[OpenAIIngress, EngineServer]:
    return tenant_ingress(engine_cls, {"heavy": {"weight": 3.0}, "light": {}}, max_num_seqs=4, first_token_s=1.0,
                          num_reserved_slots=1)


async def test_a_light_tenant_starts_at_once_beside_a_flood(fake_engine_cls):
    app, server = reserved_ingress(fake_engine_cls)
    body = {"model": "fake", "prompt": "x", "max_tokens": 1}
    order: list[str] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.build_app()), base_url="http://test",
                                 timeout=30) as http:
        async def send(tenant: str) -> int:
            reply = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
            order.append(tenant)
            return reply.status_code

        tasks = []
        for tenant in ["heavy"] * 5 + ["light"]:
            tasks.append(asyncio.ensure_future(send(tenant)))
            await asyncio.sleep(0.02)
        gate = app.work.slots["fake"]
        # Slots 4 x 1 replica, 1 reserved, nothing started (virtual time 0): heavy fills the 3 open ones, and its
        # 4th and 5th (tags 4 and 16/3) are held; light's one request (tag 0) took the reserved slot at once.
        assert (len(server.engine.bodies), gate.num_held) == (4, 2)
        assert gate.sent_by_tenant == {"heavy": 3, "light": 1}
        assert 'fleetserve_slot_held_requests{model="fake"} 2.0' in app.platform_metrics.exposition().decode()
        statuses = await asyncio.gather(*tasks)
    assert statuses == [200] * 6
    # The first four (heavy's 3 and light's) finish after 1 s; heavy's held two after 2 s.
    assert sorted(order[:4]) == ["heavy"] * 3 + ["light"] and order[4:] == ["heavy"] * 2
    assert (gate.num_sent, gate.num_held) == (0, 0)


def test_a_reserve_of_every_slot_is_refused_naming_the_key():
    config = {"models": [{"name": "m", "source": "tiny-random-llama", "engine_args": {"max_num_seqs": 4}}],
              "limits": {"num_reserved_slots": 4}}
    with pytest.raises(ConfigError, match=r"limits.num_reserved_slots \(4\) must be below models\[m\]'s "
                                          r"max_num_seqs \(4\)"):
        parse_config(config)


async def test_a_slot_frees_at_the_engines_final_chunk_not_when_the_client_has_it_all():
    from fleetserve.deployments.ingress.limits import WorkLimits
    from fleetserve.deployments.ingress.metrics import IngressMetrics
    from fleetserve.platform.api_types import ReplicaChunk

    model = ModelConfig(name="m", source="unused", engine_args={"max_num_seqs": 4})
    work = WorkLimits(["m"], {"m": model}, LimitsConfig(num_reserved_slots=1), IngressMetrics())

    async def chunks():
        yield ReplicaChunk(b"first")
        yield ReplicaChunk(b"last", final=True)

    stream = work.guarded("m", chunks(), TenantClass("heavy", 0.75))
    await anext(stream)
    assert work.slots["m"].sent_by_tenant["heavy"] == 1
    await anext(stream)
    # The final chunk is in the ingress's hands: the engine has finished, so the slot is free while it streams on.
    assert work.slots["m"].sent_by_tenant["heavy"] == 0
    await stream.aclose()
    assert (work.slots["m"].num_sent, work.in_flight["m"]) == (0, 0)  # freed once, not twice


def test_each_ingress_replica_gates_its_part_of_the_slots():
    from fleetserve.deployments.ingress.limits import WorkLimits
    from fleetserve.deployments.ingress.metrics import IngressMetrics

    model = ModelConfig(name="m", source="unused", engine_args={"max_num_seqs": 8})
    work = WorkLimits(["m"], {"m": model}, LimitsConfig(num_reserved_slots=1), IngressMetrics(), num_parts=2)
    # 8 slots on 1 replica (before any report) over 2 ingress replicas: 4 here.
    assert work.slots["m"].num_slots == 4
