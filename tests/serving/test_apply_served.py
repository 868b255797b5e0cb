"""`fleetserve apply` on a running app: a model added and another removed while a load runs against a
third; every request of the load succeeds, and the third model keeps its replica."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from factories import model_entry

pytestmark = pytest.mark.slow
KEEP, GONE, NEW = "tiny-keep", "tiny-gone", "tiny-new"
CORES = {KEEP: "0", GONE: "1", NEW: "1"}


def config(*names: str, server: dict | None = None):
    from fleetserve.platform.config import parse_config

    return parse_config({"models": [{**model_entry(name), "resources": {"num_cpus": 0.1,
                                                                        "cpu_binding": [CORES[name]]}}
                                    for name in names], "server": server or {}})


@pytest.fixture(scope="module")
def apply_app(served):
    from ray import serve

    from fleetserve.deployments.builders import build_app

    serve.run(build_app(config(KEEP, GONE)), name="apply", route_prefix="/apply")
    yield f"{served.base_url}/apply"
    serve.delete("apply")


async def open_loop_load(url: str, stop: threading.Event, rate: float = 4.0) -> list[tuple[float, int, str]]:
    """Requests to KEEP at ``rate``/s, each sent without waiting for the last, until ``stop``; returns each
    one's (send time, status, replica) once all have finished."""

    async def one(http: httpx.AsyncClient, index: int) -> tuple[float, int, str]:
        sent_at = time.monotonic()
        response = await http.post(f"{url}/v1/completions", json={"model": KEEP, "prompt": f"request {index}",
                                                                   "max_tokens": 8, "ignore_eos": True})
        return sent_at, response.status_code, response.headers.get("x-fleetserve-replica", "")

    async with httpx.AsyncClient(timeout=300) as http:
        tasks = []
        while not stop.is_set():
            tasks.append(asyncio.create_task(one(http, len(tasks))))
            await asyncio.sleep(1 / rate)
        return await asyncio.gather(*tasks)


def test_apply_adds_and_removes_models_while_another_keeps_serving(apply_app):
    from fleetserve.deployments.apply import apply_config

    stop, results = threading.Event(), []
    load = threading.Thread(target=lambda: results.append(asyncio.run(open_loop_load(apply_app, stop))))
    load.start()
    time.sleep(3)
    applying = time.monotonic()
    change = apply_config(config(KEEP, NEW), app_name="apply", route_prefix="/apply")
    applied = time.monotonic()
    time.sleep(3)
    stop.set()
    load.join(timeout=300)
    assert (change.added, change.removed, change.changed) == ([NEW], [GONE], {})
    [sent] = results
    during = [status for sent_at, status, _ in sent if applying <= sent_at <= applied]
    # At 4/s, the load runs before, through (a new engine starts: tens of seconds) and after the change.
    assert len(during) >= 4 and sent[0][0] < applying and sent[-1][0] > applied
    assert [status for _, status, _ in sent] == [200] * len(sent)  # nothing fails as the ingress rolls
    assert len({replica for _, _, replica in sent}) == 1  # KEEP was not restarted
    names = {card["id"] for card in httpx.get(f"{apply_app}/v1/models", timeout=30).json()["data"]}
    assert names == {KEEP, NEW}
    body = {"prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{apply_app}/v1/completions", json={"model": NEW, **body}, timeout=60).status_code == 200
    gone = httpx.post(f"{apply_app}/v1/completions", json={"model": GONE, **body}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_apply_turns_on_cors_and_refuses_a_new_port(apply_app):
    from fleetserve.deployments.apply import apply_config, plan_change
    from fleetserve.platform.config import ConfigError

    origin = "https://chat.example.com"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in httpx.options(f"{apply_app}/v1/completions", headers=preflight,
                                                              timeout=30).headers
    change = apply_config(config(KEEP, NEW, server={"cors": {"allowed_origins": [origin]}}), app_name="apply",
                          route_prefix="/apply")
    assert change.sections == ["server"] and change.changed == {}
    answered = httpx.options(f"{apply_app}/v1/completions", headers=preflight, timeout=30)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == origin
    with pytest.raises(ConfigError, match="server: port cannot change while the platform runs"):
        plan_change(config(KEEP, NEW, server={"port": 9000, "cors": {"allowed_origins": [origin]}}), "apply")
