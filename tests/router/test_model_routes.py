"""Routed model names: parsing, tier choice, calibrated thresholds, config validation, and the ingress."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from factories import EASY_PROMPT, HARD_PROMPT, calibrated_classifier, synthetic_correctness

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.platform.config import ConfigError, ModelConfig, ModelRoutingConfig, parse_config
from fleetserve.router.model.embedders import make_embedder
from fleetserve.router.model.routes import RouteError, RouteTable, routing_text
from fleetserve.router.model.quality_router import train_router
from fleetserve.router.model.routing_data import CorrectnessTable

HARD, EASY = HARD_PROMPT, EASY_PROMPT


@pytest.fixture(scope="module")
def classifier():
    return calibrated_classifier(0.25)


def table(classifier, **routing) -> RouteTable:
    config = ModelRoutingConfig.model_validate({"tiers": ["cheap", "pricey"], **routing})
    return RouteTable(config, routers={"classifier": classifier})


def test_threshold_extremes_pick_strongest_and_cheapest(classifier):
    routes = table(classifier)
    for text in (HARD, EASY):
        assert RouteTable.choose(routes.resolve("router-classifier-0"), text).model == "pricey"
        assert RouteTable.choose(routes.resolve("router-classifier-1"), text).model == "cheap"
        assert RouteTable.choose(routes.resolve("router-classifier-1.0"), text).model == "cheap"


def test_mid_threshold_escalates_only_the_prompt_the_strong_model_wins(classifier):
    routes = table(classifier)
    # Both models answer easy prompts (a tie: win rate near 0.5); only the strong one answers hard ones.
    route = routes.resolve("router-classifier-0.7")
    hard, easy = RouteTable.choose(route, HARD), RouteTable.choose(route, EASY)
    assert (hard.model, easy.model) == ("pricey", "cheap")
    assert hard.win_rate == classifier.strong_win_rate(HARD) >= 0.7 > easy.win_rate
    assert hard.strongest_model == easy.strongest_model == "pricey"


def test_named_route_uses_the_checkpoints_calibrated_threshold(classifier):
    routes = table(classifier, routes=[{"name": "auto", "router": "classifier", "strong_fraction": 0.25}])
    route = routes.resolve("auto")
    assert route.threshold == classifier.metadata["calibrations"][0]["threshold"]
    data = synthetic_correctness()
    chosen = [RouteTable.choose(route, prompt).model for prompt in data.prompts]
    # Calibrated on these 40 prompts at 25%: exactly the 10 hard ones go to the strong tier.
    assert chosen.count("pricey") == 10
    assert routes.names() == ["auto"]


def test_uncalibrated_strong_fraction_says_which_command_to_run(classifier):
    with pytest.raises(RouteError, match=r"no calibration for strong_fraction 0.4 \(it has \[0.25\]\).*router calibrate"):
        table(classifier, routes=[{"name": "auto", "router": "classifier", "strong_fraction": 0.4}])


def test_random_route_strong_fraction_is_analytic(classifier):
    routes = table(classifier, routes=[{"name": "coin", "router": "random", "strong_fraction": 0.3}])
    assert routes.resolve("coin").threshold == pytest.approx(0.7)  # uniform rates: P(rate >= 0.7) = 0.3


@pytest.mark.parametrize("name, message", [
    ("router-nope-0.5", "unknown router `nope`"),
    ("router-classifier-abc", "malformed threshold `abc`"),
    ("router-classifier-1.5", "malformed threshold `1.5`"),
    ("router-classifier-nan", "malformed threshold `nan`"),
    ("router-classifier", "is not a route"),
])
def test_bad_routed_names_list_the_valid_routes(classifier, name, message):
    with pytest.raises(RouteError, match=message) as error:
        table(classifier).resolve(name)
    assert "router-<random|classifier>-<threshold in [0, 1]>" in str(error.value)


def test_three_tiers_pick_the_cheapest_the_strongest_does_not_beat():
    # Three kinds of prompt: every model answers "say hello"; only mid and strong answer "summarize";
    # only strong answers "prove". Columns: weak, mid, strong.
    kinds = {"say hello politely": [True, True, True], "summarize the long article": [False, True, True],
             "prove this difficult theorem": [False, False, True]}
    prompts = [f"{text} case {i}" for i in range(12) for text in kinds]
    correct = np.array([kinds[prompt.rsplit(" case", 1)[0]] for prompt in prompts])
    router = train_router("classifier", CorrectnessTable(prompts, ["weak", "mid", "strong"], correct),
                          make_embedder("hashing-256"))
    assert router.models == ["weak", "mid", "strong"]  # accuracies 12/36, 24/36, 36/36
    config = ModelRoutingConfig.model_validate({"tiers": ["t0", "t1", "t2"]})
    route = RouteTable(config, routers={"classifier": router}).resolve("router-classifier-0.7")
    # "prove": strong beats both cheaper tiers -> t2. "summarize": strong beats weak but ties mid
    # (win rate near 0.5 < 0.7) -> t1. "say hello": strong ties weak -> the cheapest, t0.
    assert RouteTable.choose(route, "prove this difficult theorem case 99").model == "t2"
    assert RouteTable.choose(route, "summarize the long article case 99").model == "t1"
    assert RouteTable.choose(route, "say hello politely case 99").model == "t0"


def test_routing_text_reads_the_last_user_message_by_default():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
    assert routing_text(chat, None, "last_user") == "second"
    assert routing_text(chat, None, "all_user") == "first\nsecond"
    assert routing_text(chat, None, "all") == "be brief\nfirst\nok\nsecond"
    assert routing_text(None, "a prompt", "last_user") == "a prompt"


def models_section(**costs):
    return [{"name": name, "source": "tiny-random-llama", "cost_per_million_output_tokens": cost}
            for name, cost in costs.items()]


@pytest.mark.parametrize("routing, message", [
    ({"tiers": ["a", "ghost"]}, r"\['ghost'\] are not served models"),
    ({"tiers": ["b", "a"]}, "ordered cheapest first"),
    ({"tiers": ["a"]}, "at least two distinct served models"),
    ({"tiers": ["a", "b"], "routes": [{"name": "auto", "router": "mf", "threshold": 0.5}]},
     "needs model_routing.checkpoints.mf"),
    ({"tiers": ["a", "b"], "routes": [{"name": "auto", "router": "random"}]}, "exactly one of threshold"),
    ({"tiers": ["a", "b"], "routes": [{"name": "a", "router": "random", "threshold": 0.5}]}, "already a served model"),
    ({"tiers": ["a", "b"], "routes": [{"name": "router-x", "router": "random", "threshold": 0.5}]}, "reserved"),
    ({"tiers": ["a", "b"], "checkpoints": {"knn": "x"},
      "routes": [{"name": "auto", "router": "knn", "threshold": 0.5, "out_of_domain_tier": "c"}]},
     r"out_of_domain_tier 'c' is not one of its tiers \['a', 'b'\]"),
    ({"tiers": ["a", "b"], "routes": [{"name": "auto", "router": "random", "threshold": 0.5,
                                       "out_of_domain_tier": "b"}]}, "random has no domain"),
])
def test_model_routing_config_errors_name_the_problem(routing, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"models": models_section(a=1.0, b=2.0), "model_routing": routing})


@pytest.fixture
def routed_client(fake_engine_cls, classifier):
    servers = {name: EngineServer(ModelConfig(name=name, source="unused"), engine_cls=fake_engine_cls,
                                  model_path="/unused") for name in ("cheap", "pricey")}
    models = {"cheap": ModelConfig(name="cheap", source="x", cost_per_million_output_tokens=1.0),
              "pricey": ModelConfig(name="pricey", source="x", cost_per_million_output_tokens=10.0)}
    ingress = OpenAIIngress({name: LocalModelClient(server) for name, server in servers.items()}, models=models,
                            routes=table(classifier, routes=[{"name": "auto", "router": "classifier", "threshold": 0.7}]))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.build_app()), base_url="http://test")


async def test_ingress_answers_with_the_chosen_model_and_counts_decisions(routed_client):
    async with routed_client as client:
        for text, expected in ((HARD, "pricey"), (EASY, "cheap")):
            response = await client.post("/v1/chat/completions", json={
                "model": "auto", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
            assert response.status_code == 200
            assert response.json()["model"] == expected
            assert response.headers["x-fleetserve-model"] == expected
            assert response.headers["x-fleetserve-route"] == "auto"
            assert 0.0 <= float(response.headers["x-fleetserve-win-rate"]) < 1.0
            assert response.headers["x-fleetserve-model-route-reason"] == (
                "strongest_needed" if expected == "pricey" else "below_threshold")
            assert "x-fleetserve-domain-distance" not in response.headers
        metrics = (await client.get("/metrics")).text
        assert 'fleetserve_model_route_decisions_total{model="pricey",reason="strongest_needed",route="auto"} 1.0' in metrics
        assert 'fleetserve_model_route_decisions_total{model="cheap",reason="below_threshold",route="auto"} 1.0' in metrics
        # The cheap request made 2 output tokens: saved (10 - 1) * 2 / 1e6 = 1.8e-05 dollars.
        assert 'fleetserve_route_cost_saved_dollars_total{route="auto"} 1.8e-05' in metrics
        models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert models == ["cheap", "pricey", "auto"]


async def test_ingress_rejects_bad_routes_with_openai_400(routed_client):
    async with routed_client as client:
        response = await client.post("/v1/completions", json={"model": "router-bogus-0.5", "prompt": "x"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "invalid_route" and error["param"] == "model"
        assert "named routes: auto" in error["message"]
        response = await client.post("/v1/completions", json={"model": "auto", "prompt": [1, 2]})
        assert response.status_code == 400 and "text prompt" in response.json()["error"]["message"]
        # A plain unknown model is still a 404.
        assert (await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})).status_code == 404


async def test_an_out_of_domain_prompt_goes_to_the_fallback_tier_with_its_reason(fake_engine_cls, classifier):
    servers = {name: EngineServer(ModelConfig(name=name, source="unused"), engine_cls=fake_engine_cls,
                                  model_path="/unused") for name in ("cheap", "pricey")}
    models = {"cheap": ModelConfig(name="cheap", source="x", cost_per_million_output_tokens=1.0),
              "pricey": ModelConfig(name="pricey", source="x", cost_per_million_output_tokens=10.0)}
    # Threshold 1 sends every in-domain prompt to cheap, so only the domain check can pick pricey.
    routes = table(classifier, routes=[{"name": "auto", "router": "classifier", "threshold": 1.0,
                                        "out_of_domain_tier": "pricey"}])
    ingress = OpenAIIngress({name: LocalModelClient(server) for name, server in servers.items()}, models=models,
                            routes=routes)
    far = "SELECT count(*) FROM orders WHERE shipped IS NULL GROUP BY region"  # no word of the training prompts
    transport = httpx.ASGITransport(app=ingress.build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for text, model, reason in ((far, "pricey", "out_of_domain"), (EASY, "cheap", "below_threshold")):
            response = await client.post("/v1/chat/completions", json={
                "model": "auto", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
            assert response.status_code == 200
            assert response.headers["x-fleetserve-model"] == model
            assert response.headers["x-fleetserve-model-route-reason"] == reason
            distance = float(response.headers["x-fleetserve-domain-distance"])
            assert distance == pytest.approx(classifier.domain_distance(text), abs=1e-6)
            assert (distance > classifier.max_domain_distance) == (reason == "out_of_domain")
            # Out of domain the win rate is never computed, so none is reported.
            assert ("x-fleetserve-win-rate" in response.headers) == (reason != "out_of_domain")
        metrics = (await client.get("/metrics")).text
        assert 'fleetserve_model_route_decisions_total{model="pricey",reason="out_of_domain",route="auto"} 1.0' in metrics
