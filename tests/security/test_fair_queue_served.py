"""Fair queuing and a reserved engine slot on a real vLLM engine with priority scheduling: vLLM takes the
priorities the ingress sets (a batch tenant's included), every request completes, and nothing stays held,
in flight or running afterwards. The gate's arithmetic is tested exactly on a fake engine
(test_reserved_slots.py); this is the path through Serve and vLLM."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from cluster_helpers import metric_values, wait_all_idle
from conftest import Served
from factories import model_entry
from fleetserve.deployments.ingress.security import hash_key
from fleetserve.platform.config import parse_config

pytestmark = [pytest.mark.slow]

MODEL = "tiny-fair"
KEYS = {"flood": "sk-fair-flood-01", "light": "sk-fair-light-02", "nightly": "sk-fair-batch-03",
        "ops": "sk-fair-admin-04"}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def fair(served) -> str:
    from ray import serve

    from fleetserve.deployments.builders import build_app

    config = parse_config({
        # 2 slots, 1 reserved: a flood gets one at a time, the other is for requests on the fair schedule.
        "models": [{**model_entry(MODEL, max_num_seqs=2, extra={"scheduling_policy": "priority"}),
                    "resources": {"num_cpus": 0.1}}],
        "limits": {"num_reserved_slots": 1},
        "auth": {"tenants": {"flood": {}, "light": {}, "nightly": {"priority": "batch"}, "ops": {}},
                 "api_keys": [{"sha256": hash_key(key), "tenant": name, "admin": name == "ops"}
                              for name, key in KEYS.items()]}})
    serve.run(build_app(config), name="fair", route_prefix="/fair")
    yield f"{served.base_url}/fair"
    serve.delete("fair")


async def test_every_tenant_completes_on_a_priority_engine_with_a_reserved_slot(fair):
    body = {"model": MODEL, "prompt": "the fair queue", "max_tokens": MAX_TOKENS, "ignore_eos": True}

    async with httpx.AsyncClient(base_url=fair, timeout=120) as http:
        async def send(tenant: str) -> tuple[int, int]:
            reply = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
            usage = reply.json().get("usage") or {}
            return reply.status_code, usage.get("completion_tokens", 0)

        results = await asyncio.gather(*[send(tenant) for tenant in ["flood"] * 6 + ["light", "nightly"]])
        # Each request generates its whole budget: vLLM took every priority (0 up to 10^18 + tags) it was sent.
        assert results == [(200, MAX_TOKENS)] * 8
        metrics = (await http.get("/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"})).text
    # Showback from the engines' usage: each tenant's completion tokens, all 24 of each of its requests.
    completion = {labels["tenant"]: value for labels, value in metric_values(metrics, "fleetserve_tenant_tokens_total")
                  if labels["model"] == MODEL and labels["kind"] == "completion"}
    assert completion == {"flood": 6 * MAX_TOKENS, "light": MAX_TOKENS, "nightly": MAX_TOKENS}
    held = metric_values(metrics, "fleetserve_slot_held_requests")
    in_flight = metric_values(metrics, "fleetserve_in_flight_requests")
    assert [value for labels, value in held if labels["model"] == MODEL] == [0.0]
    assert [value for labels, value in in_flight if labels["model"] == MODEL] == [0.0]
    gauges = wait_all_idle(fair, MODEL, num_replicas=1, headers={"Authorization": f"Bearer {KEYS['ops']}"})
    assert list(gauges.values()) == [{"running": 0.0, "waiting": 0.0, "kv": 0.0}]


def run_status(url: str, key: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetserve.cli", "status", "--url", url, "--once",
                           "--interval", "0.2"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FLEETSERVE_API_KEY": key})


def test_status_reads_an_auth_platform_with_an_admin_key_only(fair):
    shown = run_status(fair, KEYS["ops"])
    assert shown.returncode == 0, shown.stderr
    assert f"{MODEL}: 1 replica" in shown.stdout
    no_key = run_status(fair, "")
    assert no_key.returncode == 1 and "401: auth is on; pass an admin key" in no_key.stderr
    not_admin = run_status(fair, KEYS["light"])
    assert not_admin.returncode == 1 and "403: the key given is not an admin key" in not_admin.stderr


def test_anthropic_sdk_calls_messages_with_its_own_key_header(fair):
    import anthropic

    # The batch tenant's too: vLLM takes its priority (10^18 + its tag) in the chat request it converts to.
    for tenant in ("light", "nightly"):
        client = anthropic.Anthropic(base_url=fair, api_key=KEYS[tenant], max_retries=0)
        reply = client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}])
        assert reply.usage.output_tokens == 4 and reply.stop_reason == "max_tokens"
