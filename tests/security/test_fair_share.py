"""Weighted fair shares of the admission queue: one tenant's flood cannot take the whole queue, so a light
tenant is still admitted. On a fake engine whose first token takes 2 s, so every admitted request stays
queued while the rest arrive; the arithmetic of each admission is in the comments."""

from __future__ import annotations

import asyncio

import httpx

from tenant_ingress import KEYS, tenant_ingress

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.fair_queue import BATCH_PRIORITY, FairQueue
from fleetserve.deployments.ingress.server import OpenAIIngress


def flooded_ingress(engine_cls, **weights: float) -> OpenAIIngress:
    # One sequence per step: the engine's only free slot is the one headroom place. A queue of 8
    # (min_queued_per_replica with 1 replica and no completions yet); shares apply past half of it, and each
    # is a weighted part of the queue plus the engine's slot: every request admitted and not finished.
    app, _ = tenant_ingress(engine_cls, {name: {"weight": weights.get(name, 1.0)} for name in KEYS})
    return app


async def flood(app: OpenAIIngress, requests: list[str]) -> dict[str, list[int]]:
    """Sends each tenant's request in order, each once the previous one is admitted or refused."""
    body = {"model": "fake", "prompt": "x", "max_tokens": 1}
    statuses: dict[str, list[int]] = {name: [] for name in KEYS}
    transport = httpx.ASGITransport(app=app.build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
        async def send(tenant: str) -> None:
            response = await http.post("/v1/completions", json=body,
                                       headers={"Authorization": f"Bearer {KEYS[tenant]}"})
            statuses[tenant].append(response.status_code)

        tasks = []
        for tenant in requests:
            tasks.append(asyncio.ensure_future(send(tenant)))
            await asyncio.sleep(0.02)  # admitted (now waiting on its first token) or refused by now
        await asyncio.gather(*tasks)
    return statuses


async def test_a_flood_takes_its_share_and_a_light_tenant_still_gets_in(fake_engine_cls):
    app = flooded_ingress(fake_engine_cls)
    statuses = await flood(app, ["heavy"] * 20 + ["light"] * 5)
    # The k-th request makes k waiting, less the engine's one free slot: queued = k - 1 (at least 1). Up to
    # half the queue (4) anyone is admitted, so heavy's first 5 are; its 6th (queued 5 > 4) would make 6 of
    # its own against a share of floor(0.5 x (8 queue places + 1 engine slot)) = 4: refused, as are
    # the other 14.
    assert sorted(statuses["heavy"]) == [200] * 5 + [503] * 15
    # light's j-th makes queued 4 + j, past half: its 1st-4th hold 1-4 of its share of 4, and its 5th finds
    # the queue full (9 > 8). Without shares, heavy would have taken all 8 places and light none.
    assert sorted(statuses["light"]) == [200] * 4 + [503]


async def test_weights_split_the_queue(fake_engine_cls):
    app = flooded_ingress(fake_engine_cls, heavy=3.0)
    statuses = await flood(app, ["heavy"] * 20 + ["light"] * 5)
    # heavy's share is floor(3/4 x (8 + 1)) = 6: its first 5 freely, its 6th (queued 5) holds 6 of 6, its 7th
    # is refused. light's share is floor(1/4 x 9) = 2: its j-th makes queued 5 + j; its 1st and 2nd hold
    # 1 and 2 of 2, its 3rd would be a 3rd.
    assert sorted(statuses["heavy"]) == [200] * 6 + [503] * 14
    assert sorted(statuses["light"]) == [200] * 2 + [503] * 3


BATCH_HEAVY = {"heavy": {"weight": 3.0, "priority": "batch"}, "light": {}}


def classed_ingress(engine_cls, scheduling_policy: str | None = None,
                    tenants: dict = BATCH_HEAVY) -> tuple[OpenAIIngress, EngineServer]:
    return tenant_ingress(engine_cls, tenants, scheduling_policy=scheduling_policy)


async def test_batch_work_leaves_the_upper_half_of_the_queue_to_interactive_work(fake_engine_cls):
    app, server = classed_ingress(fake_engine_cls)
    statuses = await flood(app, ["heavy"] * 20 + ["light"] * 5)
    # heavy is batch: up to half the queue (queued <= 4) it is admitted, 5 requests, though its weight (3 of
    # 4) would allow floor(3/4 x 9) = 6. light (share floor(1/4 x 9) = 2) makes queued 5 + j: 2 admitted,
    # then its share.
    assert sorted(statuses["heavy"]) == [200] * 5 + [503] * 15
    assert sorted(statuses["light"]) == [200] * 2 + [503] * 3
    # The engine does not schedule by priority: no priority is forwarded, in the body or the header.
    assert all("priority" not in body for body in server.engine.bodies)
    assert server.engine.priorities == [0] * 7  # the 5 + 2 admitted


async def test_on_a_priority_scheduled_engine_the_platform_sets_each_requests_priority(fake_engine_cls):
    app, server = classed_ingress(fake_engine_cls, scheduling_policy="priority")
    body = {"model": "fake", "prompt": "x", "max_tokens": 1}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.build_app()), base_url="http://test",
                                 timeout=30) as http:
        for tenant in ("heavy", "light"):
            reply = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
            assert reply.status_code == 200
    # batch runs after every interactive request: vLLM's priority BATCH_PRIORITY + 0 and 0 (lower first); each
    # tenant's first request is tagged at the virtual time, 0.
    assert server.engine.priorities == [BATCH_PRIORITY, 0]
    # Sent in vLLM's priority header; the body goes as the caller sent it.
    assert all("priority" not in body for body in server.engine.bodies)


async def test_a_callers_own_priority_is_refused_where_the_platform_sets_it(fake_engine_cls):
    app, server = classed_ingress(fake_engine_cls, scheduling_policy="priority")
    body = {"model": "fake", "prompt": "x", "max_tokens": 1, "priority": -5}  # an attempt to jump the queue
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.build_app()), base_url="http://test",
                                 timeout=30) as http:
        refused = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['light']}"})
        default = await http.post("/v1/completions", json={**body, "priority": 0},
                                  headers={"Authorization": f"Bearer {KEYS['light']}"})
    error = refused.json()["error"]
    assert (refused.status_code, error["param"], error["code"]) == (400, "priority", "unsupported_parameter")
    # vLLM's default, 0, asks for nothing: served at the platform's priority (light's first tag, 0).
    assert default.status_code == 200 and server.engine.priorities == [0] and app.in_flight == {"fake": 0}


async def test_anthropic_messages_take_the_platforms_priority_whatever_the_caller_sends(fake_engine_cls):
    app, server = classed_ingress(fake_engine_cls, scheduling_policy="priority")
    body = {"model": "fake", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.build_app()), base_url="http://test",
                                 timeout=30) as http:
        for tenant in ("heavy", "light"):
            # vLLM's own header, sent by the caller to jump the queue: the ingress does not pass it on.
            reply = await http.post("/v1/messages", json=body, headers={"x-api-key": KEYS[tenant],
                                                                         "x-vllm-priority": "-100"})
            assert reply.status_code == 200 and "event: message_stop" in reply.text
    # Anthropic's request has no priority field; the header reaches the chat request vLLM converts it into.
    # heavy is batch: BATCH_PRIORITY + its tag 0; light's first request is tagged 0.
    assert server.engine.priorities == [BATCH_PRIORITY, 0]


async def test_on_a_priority_scheduled_engine_a_light_tenant_goes_before_a_floods_backlog(fake_engine_cls):
    # Both interactive, weights 3:1 (shares 0.75 and 0.25); every request stays in flight (first token at 2 s).
    app, server = classed_ingress(fake_engine_cls, scheduling_policy="priority",
                                  tenants={"heavy": {"weight": 3.0}, "light": {}})
    statuses = await flood(app, ["heavy"] * 5 + ["light"] * 2)
    # Admission: heavy's k-th makes queued k - 1 <= 4 (half the queue of 8): all 5 in. light's j-th makes queued
    # 4 + j > 4 and holds j of its share floor(0.25 x (8 + 1)) = 2: both in.
    assert statuses == {"heavy": [200] * 5, "light": [200] * 2}
    # Start tags (none started yet, so the virtual time stays 0): each request starts where its tenant's last
    # ended, a request costing 1 / share. heavy: 0, 4/3, 8/3, 4, 16/3; light: 0, 4. In priority steps of 1/1000:
    # light's first runs before heavy's 2nd-5th though it came after them, and its second ties heavy's 4th.
    assert server.engine.priorities == [0, 1333, 2667, 4000, 5333, 0, 4000]


def test_a_floods_tags_keep_their_order_as_its_requests_start():
    fair = FairQueue()
    flood = [fair.tag("m", "flood", 0.5) for _ in range(4)]
    # Each flood request costs 1 / 0.5 = 2: tags 0, 2, 4, 6.
    assert flood == [0.0, 2.0, 4.0, 6.0]
    fair.started("m", flood[0])
    fair.started("m", flood[1])
    # The virtual time is 2, the last started tag. A new flood request queues after the flood's own (8), never
    # ahead of its earlier ones, while a light tenant's first request is tagged at the virtual time, 2: ahead
    # of the flood's backlog (4 and 6).
    assert (fair.tag("m", "flood", 0.5), fair.tag("m", "light", 0.5)) == (8.0, 2.0)
    # Another model keeps its own virtual time.
    assert fair.tag("other", "flood", 0.5) == 0.0


async def test_refused_requests_take_no_place_in_the_fair_queue(fake_engine_cls):
    app, server = classed_ingress(fake_engine_cls, scheduling_policy="priority",
                                  tenants={"heavy": {"weight": 3.0}, "light": {}})
    statuses = await flood(app, ["heavy"] * 20 + ["light"] * 5)
    # As in test_weights_split_the_queue: heavy gets 6 places, light 2.
    assert sorted(statuses["heavy"]) == [200] * 6 + [503] * 14
    # Only admitted requests are tagged: heavy's 6 at 0, 4/3, ..., 20/3 (priorities 0-6667), light's 2 at 0, 4.
    assert server.engine.priorities == [0, 1333, 2667, 4000, 5333, 6667, 0, 4000]
    statuses = await flood(app, ["heavy"])
    # All started, so the virtual time is the largest tag, 20/3; heavy's next starts where its 6th ended,
    # 6 x 4/3 = 8 (its 14 refusals would have put it at 26 2/3).
    assert statuses["heavy"] == [200]
    assert server.engine.priorities[-1] == 8000
