"""/metrics on a running platform: every replica's vLLM series, platform counters that add up,
a dashboard whose every metric exists, `fleetserve status`, and a real Prometheus server scraping it."""

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.loadtest.local_server import free_port

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "fleetserve" / "dashboards" / "fleetserve.json"
MODEL = "tiny-cache-aware"


def scrape(base_url: str) -> list:
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return list(text_string_to_metric_families(response.text))


def total(families, name: str, **labels) -> float:
    return sum(sample.value for family in families for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def replicas_of(families, name: str, model: str) -> set[str]:
    return {s.labels["replica"] for f in families for s in f.samples if s.name == name and s.labels["model_name"] == model}


def send(base_url: str, count: int, max_tokens: int = 4) -> None:
    with httpx.Client(timeout=120) as http:
        for index in range(count):
            # Distinct prompts: cache-aware routing spreads new prefixes over both replicas.
            response = http.post(f"{base_url}/v1/completions", json={
                "model": MODEL, "prompt": f"request {index} " + "word " * (20 + index * 7), "max_tokens": max_tokens,
                "ignore_eos": True})
            assert response.status_code == 200


def wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_counters_summed_over_replicas_equal_requests_served(two_replica_app):
    url = two_replica_app.base_url
    before = scrape(url)
    send(url, 10)
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1}, timeout=30)
    assert bad.status_code == 400

    def settled():
        families = scrape(url)
        served = total(families, "vllm:request_success_total", model_name=MODEL) - \
            total(before, "vllm:request_success_total", model_name=MODEL)
        return families if served == 10 else None

    families = wait_for(settled)  # replicas publish about once a second
    assert families, "engine counters did not reach the 10 requests served"
    # Both replicas report, each with its own series.
    assert len(replicas_of(families, "vllm:request_success_total", MODEL)) == 2
    # 10 requests x 4 tokens (ignore_eos), summed across replicas.
    assert total(families, "vllm:generation_tokens_total", model_name=MODEL) - \
        total(before, "vllm:generation_tokens_total", model_name=MODEL) == 40
    ok = dict(route="/v1/completions", model=MODEL, status="200")
    assert total(families, "fleetserve_requests_total", **ok) - total(before, "fleetserve_requests_total", **ok) == 10
    assert total(families, "fleetserve_requests_total", route="/v1/completions", status="400") >= 1
    assert total(families, "fleetserve_replicas", model=MODEL, pool="colocated") == 2
    assert total(families, "fleetserve_routing_decisions_total", model=MODEL) >= 10
    assert total(families, "fleetserve_ingress_queue_seconds_count", model=MODEL) >= 10
    # Prices: $1 per 1M input, $2 per 1M output tokens: positive, and at least 40 output tokens' worth.
    assert total(families, "fleetserve_estimated_cost_dollars_total", model=MODEL) >= 40 * 2 / 1e6


def test_every_dashboard_metric_is_in_a_live_scrape(two_replica_app):
    send(two_replica_app.base_url, 2)
    exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]
    wanted = {name for expr in exprs for name in re.findall(r"\b(vllm:[a-z0-9_]+|fleetserve_[a-z0-9_]+)", expr)}
    # Only a model with speculative decoding has these: test_metrics_units finds them in its engine metrics.
    wanted = {name for name in wanted if not name.startswith("vllm:spec_decode")}

    def missing():
        live = {sample.name for family in scrape(two_replica_app.base_url) for sample in family.samples}
        return wanted - live

    assert wait_for(lambda: not missing()), f"not in /metrics: {sorted(missing())}"


def test_every_replica_reports_when_it_started_and_each_start_phase(two_replica_app):
    send(two_replica_app.base_url, 2)
    families = scrape(two_replica_app.base_url)
    replicas = replicas_of(families, "vllm:num_requests_running", MODEL)
    started = {s.labels["replica"]: s.value for f in families for s in f.samples
               if s.name == "fleetserve_replica_start_time_seconds" and s.labels["model_name"] == MODEL}
    phases = {(s.labels["replica"], s.labels["phase"]): s.value for f in families for s in f.samples
              if s.name == "fleetserve_replica_startup_seconds" and s.labels["model_name"] == MODEL}
    assert len(replicas) == 2 and set(started) == replicas
    # Each replica began before this scrape, and timed all three phases (the app's was done: it served).
    assert all(0 < value < time.time() for value in started.values())
    assert set(phases) == {(replica, phase) for replica in replicas for phase in ("model_files", "engine", "app")}
    assert all(value >= 0 for value in phases.values())


def test_status_once_shows_each_replica(two_replica_app):
    send(two_replica_app.base_url, 2)
    done = subprocess.run([sys.executable, "-m", "fleetserve.cli", "status", "--url", two_replica_app.base_url,
                           "--once", "--interval", "0.5"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if MODEL in line and "colocated" in line]
    assert len(rows) == 2  # one row per replica
    assert "tiny-cache-aware: 2 replicas" in done.stdout and "tiny-default: 2 replicas" in done.stdout


def test_status_fails_clearly_when_unreachable():
    done = subprocess.run([sys.executable, "-m", "fleetserve.cli", "status", "--url", "http://127.0.0.1:9", "--once"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot read http://127.0.0.1:9/metrics" in done.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed "
                    "(make test installs it with apt-get when run as root)")
def test_real_prometheus_scrapes_ttft_quantiles_and_kv_usage(two_replica_app, tmp_path):
    from urllib.parse import urlsplit

    target = urlsplit(two_replica_app.base_url)
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: fleetserve\n    metrics_path: {target.path}/metrics\n"
        f"    static_configs: [{{targets: ['{target.netloc}']}}]\n")
    process = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def query(promql: str) -> list:
        try:
            return httpx.get(api, params={"query": promql}, timeout=5).json()["data"]["result"]
        except (httpx.HTTPError, KeyError, ValueError):
            return []

    try:
        # Traffic must come after Prometheus's first scrape, or it never sees the counters rise.
        up = wait_for(lambda: [r for r in query('up{job="fleetserve"}') if r["value"][1] == "1"], timeout_s=60)
        targets = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json() if not up else {}
        assert up, f"Prometheus could not scrape fleetserve: {targets}"
        send(two_replica_app.base_url, 6)
        time.sleep(2)
        send(two_replica_app.base_url, 6)

        promql = ('histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
                  f'{{model_name="{MODEL}"}}[1m])))')

        def ttft_quantile() -> float | None:
            # NaN until Prometheus has two scrapes that show the counters rising.
            result = query(promql)
            value = float(result[0]["value"][1]) if result else math.nan
            return value if not math.isnan(value) else None

        ttft = wait_for(ttft_quantile, timeout_s=40)
        assert ttft is not None, f"no TTFT quantile; TTFT counts seen: {query('vllm:time_to_first_token_seconds_count')}"
        assert 0 < ttft < 10  # seconds: plausible for a tiny model on CPU
        kv = wait_for(lambda: query(f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}}'), timeout_s=20)
        assert len(kv) == 2 and all(0.0 <= float(series["value"][1]) <= 1.0 for series in kv)
    finally:
        process.terminate()
        process.wait(timeout=30)

