"""Routed model names end to end: the suite's Serve app, two real engines, the official openai client."""

from __future__ import annotations

import json

import openai
import pytest
from factories import synthetic_correctness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.api_url, api_key="unused", max_retries=0)


def ask(client, model: str, text: str):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0)
    return raw.parse().model, raw.headers


@pytest.mark.parametrize("threshold, expected", [("0", "smollm2"), ("1", "tiny")])
def test_threshold_extremes_send_every_request_to_one_model(client, threshold, expected):
    for prompt in synthetic_correctness(num_prompts=8).prompts:
        model, headers = ask(client, f"router-classifier-{threshold}", prompt)
        assert model == expected
        assert headers["x-fleetserve-model"] == expected
        assert headers["x-fleetserve-route"] == f"router-classifier-{threshold}"


def test_calibrated_route_splits_its_reference_set_as_calibrated(client, routing_checkpoint):
    calibration = json.loads((routing_checkpoint / "metadata.json").read_text())["calibrations"][0]
    assert calibration["strong_fraction"] == 0.5 and calibration["num_prompts"] == 40
    chosen = [ask(client, "auto", prompt)[0] for prompt in synthetic_correctness().prompts]
    # Calibrated on these 40 prompts at 50%. Easy prompts share tied win rates, so a threshold cannot
    # split them evenly: calibration recorded the share it actually achieves, and serving must match it.
    assert chosen.count("smollm2") == round(calibration["achieved_fraction"] * 40)
    assert chosen.count("smollm2") + chosen.count("tiny") == 40
    # The 10 hard prompts (every 4th) have the highest strong win rates, so all of them escalate.
    assert all(chosen[i] == "smollm2" for i in range(0, 40, 4))


def test_bad_route_is_a_400_listing_valid_routes(client, served):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="router-bogus-0.3", prompt="hi", max_tokens=1)
    assert error.value.status_code == 400
    assert "named routes: auto" in error.value.message
    with pytest.raises(openai.BadRequestError, match="malformed threshold"):
        client.completions.create(model="router-classifier-high", prompt="hi", max_tokens=1)
    # Still healthy and still routing.
    assert ask(client, "router-classifier-0", "hello")[0] == "smollm2"


def test_decisions_and_savings_are_in_metrics(client, served):
    import httpx

    ask(client, "router-classifier-1", "say hello politely")
    text = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    assert 'fleetserve_model_route_decisions_total{model="tiny",reason="below_threshold",route="router-classifier-1"}' in text
    saved = [line for line in text.splitlines()
             if line.startswith('fleetserve_route_cost_saved_dollars_total{route="router-classifier-1"}')]
    assert saved and float(saved[0].split()[-1]) > 0.0
