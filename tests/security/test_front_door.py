"""API keys, tenants, model permissions and rate limits, through the official openai client.

The ingress runs on a loopback port with an injected fake engine (no Ray): what is under test is the
front door, which runs before any engine work.
"""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
import yaml

from fleetserve.deployments.engine_server import EngineServer
from fleetserve.deployments.ingress.model_clients import LocalModelClient
from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.deployments.ingress.server import OpenAIIngress
from fleetserve.deployments.ingress.security import FrontDoor, RateLimiter, TokenBucket, hash_key
from fleetserve.platform.config import AuthConfig, ConfigError, ModelConfig, TenantConfig, parse_config

KEYS = {"alpha": "sk-alpha-0001", "beta": "sk-beta-0002", "ops": "sk-ops-0003"}


def auth_config(**tenants) -> AuthConfig:
    tenants = tenants or {
        "alpha": {"models": ["small"], "requests_per_minute": 3},
        "beta": {"models": ["*"]},
        "ops": {},
    }
    return AuthConfig.model_validate({
        "tenants": tenants,
        "api_keys": [{"sha256": hash_key(KEYS[name]), "tenant": name, "admin": name == "ops"} for name in tenants]})


@pytest.fixture
def endpoint(fake_engine_cls, loopback_server):
    servers = {name: EngineServer(ModelConfig(name=name, source="unused"), engine_cls=fake_engine_cls,
                                  model_path="/unused") for name in ("small", "large")}
    ingress = OpenAIIngress({name: LocalModelClient(server) for name, server in servers.items()},
                            front_door=FrontDoor(auth_config()))
    with loopback_server(ingress.build_app()) as server:
        yield server.url


def client(endpoint: str, tenant: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint}/v1", api_key=KEYS.get(tenant, "sk-not-a-key"), max_retries=0)


def complete(endpoint: str, tenant: str | None, model: str = "small"):
    return client(endpoint, tenant).completions.create(model=model, prompt="a b c", max_tokens=2)


def test_missing_or_unknown_key_is_401(endpoint):
    with pytest.raises(openai.AuthenticationError) as raised:
        complete(endpoint, "nobody")
    assert raised.value.code == "invalid_api_key" and "Incorrect API key" in raised.value.message
    missing = httpx.post(f"{endpoint}/v1/completions", json={"model": "small", "prompt": "x"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    # Checked before the body: a keyless caller with a bad body still learns only that it needs a key.
    assert httpx.post(f"{endpoint}/v1/completions", json={"bad": 1}).status_code == 401
    assert httpx.get(f"{endpoint}/health").status_code == 200


def test_tenant_sees_and_uses_only_its_models(endpoint):
    assert complete(endpoint, "alpha").choices[0].text == "w0 w1"
    with pytest.raises(openai.PermissionDeniedError) as raised:
        complete(endpoint, "alpha", model="large")
    assert raised.value.code == "model_not_allowed"
    assert [model.id for model in client(endpoint, "alpha").models.list()] == ["small"]
    assert [model.id for model in client(endpoint, "beta").models.list()] == ["small", "large"]
    with pytest.raises(openai.NotFoundError):
        complete(endpoint, "beta", model="absent")


def test_metrics_need_an_admin_key(endpoint):
    assert httpx.get(f"{endpoint}/metrics").status_code == 401
    headers = {"Authorization": f"Bearer {KEYS['beta']}"}
    denied = httpx.get(f"{endpoint}/metrics", headers=headers)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_required"
    allowed = httpx.get(f"{endpoint}/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"})
    assert allowed.status_code == 200 and "fleetserve_requests_total" in allowed.text


def test_one_tenants_burst_is_limited_while_another_keeps_going(endpoint):
    # alpha may send 3 requests per minute: the 4th within the minute is refused with Retry-After.
    for _ in range(3):
        complete(endpoint, "alpha")
    with pytest.raises(openai.RateLimitError) as raised:
        complete(endpoint, "alpha")
    response = raised.value.response
    assert raised.value.code == "rate_limit_exceeded"
    # The bucket refills at 3/60 per second: one request needs 20 s.
    assert 19 <= int(response.headers["retry-after"]) <= 20
    assert [complete(endpoint, "beta").choices[0].text for _ in range(5)] == ["w0 w1"] * 5


def test_rate_limit_headers_report_both_budgets_after_each_charge():
    now = [0.0]
    limiter = RateLimiter({"t": TenantConfig(requests_per_minute=6, tokens_per_minute=1_000_000),
                           "free": TenantConfig()}, clock=lambda: now[0])
    limiter.admit("t", 250_000)
    now[0] = 1.5
    # Requests: 5 left + 1.5 s x 6/60 = 5.15, full in 0.85 / 0.1 = 8.5 s. Tokens: 750,000 + 1.5 x 16,666.67 =
    # 775,000, full in 225,000 / 16,666.67 = 13.5 s.
    assert limiter.headers("t") == {
        "x-ratelimit-limit-requests": "6", "x-ratelimit-remaining-requests": "5", "x-ratelimit-reset-requests": "8.5s",
        "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "775000",
        "x-ratelimit-reset-tokens": "13.5s"}
    assert limiter.headers("free") == {}  # no limits, nothing to report


def test_responses_carry_the_tenants_rate_limit_headers(endpoint):
    reply = client(endpoint, "alpha").completions.with_raw_response.create(model="small", prompt="a b c",
                                                                           max_tokens=2)
    # alpha: 3 requests a minute, one spent; it refills at 3/60 a second, so the bucket is full in ~20 s.
    assert reply.headers["x-ratelimit-limit-requests"] == "3"
    assert reply.headers["x-ratelimit-remaining-requests"] == "2"
    assert 19.0 <= float(reply.headers["x-ratelimit-reset-requests"].removesuffix("s")) <= 20.0
    assert "x-ratelimit-limit-tokens" not in reply.headers  # alpha has no token budget
    beta = client(endpoint, "beta").completions.with_raw_response.create(model="small", prompt="a", max_tokens=2)
    assert not [name for name in beta.headers if name.startswith("x-ratelimit")]


def test_token_bucket_arithmetic():
    bucket = TokenBucket(capacity=60, rate_per_s=1.0, now=0.0)
    assert bucket.wait_for(60, now=0.0) == 0.0
    bucket.take(60)
    # Empty at t=0; at t=10 it holds 10, so 25 more needs 15 s.
    assert bucket.wait_for(25, now=10.0) == 15.0
    assert bucket.wait_for(61, now=10.0) == float("inf")


def test_tokens_per_minute_charge_prompt_and_budget_and_refuse_nothing_twice():
    now = [0.0]
    limiter = RateLimiter({"t": TenantConfig(tokens_per_minute=120)}, clock=lambda: now[0])
    limiter.admit("t", 100)
    with pytest.raises(Exception) as raised:
        limiter.admit("t", 30)
    # 20 left; 30 needs 10 more at 2 tokens/s: 5 s. Full again after (120 - 20) / 2 = 50 s.
    assert raised.value.status_code == 429
    assert raised.value.headers == {"Retry-After": "5", "x-ratelimit-limit-tokens": "120",
                                    "x-ratelimit-remaining-tokens": "20", "x-ratelimit-reset-tokens": "50s"}
    now[0] = 5.0
    limiter.admit("t", 30)  # a refused request charged nothing, so this one fits exactly
    with pytest.raises(Exception, match="more than tenant 't'"):
        limiter.admit("t", 500)


def test_a_key_revoked_from_the_keys_file_stops_working_without_a_restart(tmp_path, caplog):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- {{sha256: {hash_key('sk-old')}, tenant: a}}\n")
    now = [0.0]
    door = FrontDoor(AuthConfig.model_validate({"tenants": {"a": {}, "b": {}}, "api_keys_file": str(keys)}),
                     clock=lambda: now[0])
    assert door.authenticate("Bearer sk-old").tenant == "a"
    # The secret is rotated: a new file (as Kubernetes swaps a Secret's mount) with the new key only.
    rotated = tmp_path / "rotated.yaml"
    rotated.write_text(f"- {{sha256: {hash_key('sk-new')}, tenant: b}}\n")
    rotated.replace(keys)
    now[0] = 4.9  # within KEYS_FILE_CHECK_S of the last check: not read yet
    assert door.authenticate("Bearer sk-old").tenant == "a"
    now[0] = 5.0
    with pytest.raises(APIError, match="Incorrect API key"):
        door.authenticate("Bearer sk-old")
    assert door.authenticate("Bearer sk-new").tenant == "b"
    # A broken rewrite keeps the keys in force (and says so) rather than locking every caller out.
    broken = tmp_path / "broken.yaml"
    broken.write_text("- {sha256: not-a-hash, tenant: b}\n")
    broken.replace(keys)
    now[0] = 10.0
    with caplog.at_level(logging.ERROR):
        assert door.authenticate("Bearer sk-new").tenant == "b"
    assert "keeping the previous keys" in caplog.text


def test_config_errors_and_keys_file(tmp_path):
    with pytest.raises(ConfigError, match="auth needs api_keys or api_keys_file"):
        parse_config({"models": [{"name": "m", "source": "x"}], "auth": {"tenants": {"a": {}}}})
    with pytest.raises(ConfigError, match=r"auth.tenants.a.models: \['other'\] are not served or routed names"):
        parse_config({"models": [{"name": "m", "source": "x"}], "auth": {
            "tenants": {"a": {"models": ["other"]}}, "api_keys": [{"sha256": "0" * 64, "tenant": "a"}]}})
    with pytest.raises(ConfigError, match="api_keys name tenants \\['ghost'\\]"):
        parse_config({"models": [{"name": "m", "source": "x"}], "auth": {
            "tenants": {}, "api_keys": [{"sha256": "0" * 64, "tenant": "ghost"}]}})
    with pytest.raises(ConfigError, match="sha256"):
        parse_config({"models": [{"name": "m", "source": "x"}], "auth": {
            "tenants": {"a": {}}, "api_keys": [{"sha256": "sk-plain-key", "tenant": "a"}]}})
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- {{sha256: {hash_key('sk-file')}, tenant: a}}\n")
    door = FrontDoor(AuthConfig.model_validate({"tenants": {"a": {}}, "api_keys_file": str(keys)}))
    assert door.authenticate("Bearer sk-file").tenant == "a"
    keys.write_text(f"- {{sha256: {hash_key('sk-file')}, tenant: b}}\n")
    with pytest.raises(ConfigError, match="names tenants \\['b'\\]"):
        FrontDoor(AuthConfig.model_validate({"tenants": {"a": {}}, "api_keys_file": str(keys)}))


def test_auth_off_is_loud(fake_engine_cls, caplog):
    with caplog.at_level(logging.WARNING):
        OpenAIIngress({})
    assert "AUTH IS OFF" in caplog.text


def test_cli_hashes_a_key_from_stdin():
    from typer.testing import CliRunner

    from fleetserve.cli.main import app

    result = CliRunner().invoke(app, ["auth", "hash-key"], input="sk-alpha-0001\n")
    assert result.exit_code == 0 and result.stdout.strip() == hash_key("sk-alpha-0001")


def test_cli_mints_a_key_whose_entry_holds_only_its_hash_and_lets_it_in():
    from typer.testing import CliRunner

    from fleetserve.cli.main import app

    result = CliRunner().invoke(app, ["auth", "new-key", "--tenant", "alpha"])
    assert result.exit_code == 0, result.output
    key_line, entry_line = result.stdout.splitlines()
    key = key_line.removeprefix("key (shown once): ")
    entries = yaml.safe_load(entry_line.removeprefix("api_keys entry:"))
    assert key.startswith("sk-fs-") and len(key) == len("sk-fs-") + 43  # 32 bytes in URL-safe base64
    assert entries == [{"sha256": hash_key(key), "tenant": "alpha"}] and key not in entry_line
    door = FrontDoor(AuthConfig.model_validate({"tenants": {"alpha": {}}, "api_keys": entries}))
    assert door.authenticate(f"Bearer {key}").tenant == "alpha"
    again = CliRunner().invoke(app, ["auth", "new-key", "--tenant", "alpha", "--admin"])
    assert again.stdout.splitlines()[0] != key_line and "admin: true" in again.stdout  # a new key each time


def test_each_of_n_ingress_replicas_enforces_an_equal_part_of_a_budget():
    now = [0.0]
    limiter = RateLimiter({"t": TenantConfig(requests_per_minute=10)}, clock=lambda: now[0], num_parts=2)
    # 10 a minute over 2 ingress replicas: 5 here, refilling at 5/60 a second, so 2 replicas never allow 20.
    for _ in range(5):
        limiter.admit("t", 0)
    with pytest.raises(Exception, match=r"limit 10, 5 at each of 2 ingress replicas") as raised:
        limiter.admit("t", 0)
    # One request refills in 60 / 5 = 12 s; the whole part of 5 in 60 s. The headers speak for the tenant's
    # whole budget: its limit of 10, and this part's 0 left, scaled.
    assert raised.value.headers == {"Retry-After": "12", "x-ratelimit-limit-requests": "10",
                                    "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m0s"}
    now[0] = 30.0
    # 30 s refill 30 x 5/60 = 2.5 of this part: 2.5 x 2 = 5 of the tenant's 10 left; the rest refills in 30 s.
    assert limiter.headers("t") == {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "5",
                                    "x-ratelimit-reset-requests": "30s"}



def test_a_key_in_x_api_key_is_checked_as_a_bearer_key(endpoint):
    body = {"model": "small", "prompt": "a b c", "max_tokens": 2}
    reply = httpx.post(f"{endpoint}/v1/completions", headers={"x-api-key": KEYS["beta"]}, json=body)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "w0 w1"
    wrong = httpx.post(f"{endpoint}/v1/completions", headers={"x-api-key": "sk-not-a-key"}, json=body)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    # The same key's permissions: alpha may not use `large`, whichever header carries its key.
    denied = httpx.post(f"{endpoint}/v1/completions", headers={"x-api-key": KEYS["alpha"]},
                        json={**body, "model": "large"})
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"
    # Authorization wins when both are sent: a wrong bearer key is not rescued by a right x-api-key.
    both = httpx.post(f"{endpoint}/v1/completions", json=body,
                      headers={"Authorization": "Bearer sk-not-a-key", "x-api-key": KEYS["beta"]})
    assert both.status_code == 401


def test_each_tenants_tokens_are_counted_per_model_for_showback(endpoint):
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(2):
        complete(endpoint, "alpha")
    for _ in client(endpoint, "alpha").completions.create(model="small", prompt="a b c", max_tokens=2, stream=True):
        pass
    # Anthropic's stream carries its usage in message_start and message_delta (before, it counted nothing).
    anthropic = httpx.post(f"{endpoint}/v1/messages", headers={"x-api-key": KEYS["beta"]}, json={
        "model": "large", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "a b c"}]})
    assert anthropic.status_code == 200 and "message_stop" in anthropic.text
    complete(endpoint, "beta", model="large")
    text = httpx.get(f"{endpoint}/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"}).text
    counted = {(sample.labels["tenant"], sample.labels["model"], sample.labels["kind"]): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "fleetserve_tenant_tokens_total"}
    # The fake engine counts "a b c" as 3 prompt tokens and makes the 2 asked for: alpha's 3 requests (the
    # stream's usage included) are 9 and 6, beta's two 6 and 4.
    assert counted == {("alpha", "small", "prompt"): 9.0, ("alpha", "small", "completion"): 6.0,
                       ("beta", "large", "prompt"): 6.0, ("beta", "large", "completion"): 4.0}


def test_each_tenants_cost_is_priced_at_the_models_prices(fake_engine_cls, loopback_server):
    from prometheus_client.parser import text_string_to_metric_families

    priced = ModelConfig(name="small", source="unused", cost_per_million_input_tokens=1.0,
                         cost_per_million_output_tokens=2.0)
    server = EngineServer(priced, engine_cls=fake_engine_cls, model_path="/unused")
    ingress = OpenAIIngress({"small": LocalModelClient(server)}, models={"small": priced},
                            front_door=FrontDoor(auth_config()))
    with loopback_server(ingress.build_app()) as loopback:
        complete(loopback.url, "alpha")
        text = httpx.get(f"{loopback.url}/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"}).text
    [cost] = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == "fleetserve_tenant_estimated_cost_dollars_total" and sample.labels["tenant"] == "alpha"]
    assert cost == pytest.approx((3 * 1.0 + 2 * 2.0) / 1e6)  # 3 prompt tokens at $1/M, 2 completion at $2/M
