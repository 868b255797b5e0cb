"""Cold start from zero: a request to a pool at zero replicas, until its first token, by phase; against bare
`vllm serve` started for one request (process start to first token) on the same machine.

    .venv/bin/python benchmarks/cold_start.py [--trials 5] [--variants tiny smollm2 smollm2-compiled]
        [--systems fleetserve vllm] [--out results/cold-start]

Each variant is one model config (the tiny random Llama and SmolLM2 in float32, both eager; SmolLM2 once
more with vLLM's default torch.compile). fleetserve serves it with min_replicas 0 and idles it to zero
(3 s); each trial waits for zero replicas, sends one streamed completion (8 tokens) and times its first
SSE event. Phases, one after another:

- actor start: the request's arrival to the replica's constructor (the autoscaler's decision, Ray starting
  the actor's worker process, its imports): ``fleetserve_replica_start_time_seconds``;
- model files: the HF folder found on disk (a GGUF is converted once, then cached);
- weights: vLLM's own "Loading weights took" line, from the replica's log;
- engine init: the rest of the AsyncLLM's construction (its engine-core and worker processes, each importing
  torch and vLLM; the KV cache; compilation when not eager);
- ready to first token: Serve seeing the replica RUNNING, the held request forwarded, vLLM's OpenAI app
  built (reported alongside), prefill and the first step.

Bare vLLM: ``python -m vllm.entrypoints.openai.api_server`` with the same engine args, timed from the
process's start to its first answer to /health and to the first SSE event of the same request, with the
same weights line from its log. Writes summary.json, one row per trial (trials.json) and a stacked-bar plot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from fleetserve.loadtest.local_server import free_port, wait_until_ready
from fleetserve.platform.config import ModelConfig, parse_config
from fleetserve.platform.metrics import StartupPhase

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
APP = "cold"
PHASES = ("actor_start_s", "model_files_s", "weights_s", "engine_init_s", "ready_to_first_token_s")
WEIGHTS_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")
ZERO_TIMEOUT_S = 180
BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}


def model_entry(variant: str) -> dict:
    """The variant's model config: engine args as the test suite serves them, on core 0, scaling to zero."""
    eager = not variant.endswith("-compiled")
    source, engine = {
        "tiny": ("tiny-random-llama", {"max_model_len": 1024, "kv_cache_memory_bytes": 64 * MiB}),
        "smollm2": ("smollm2-135m-instruct", {"max_model_len": 2048, "kv_cache_memory_bytes": 128 * MiB}),
    }[variant.removesuffix("-compiled")]
    return {"name": variant, "source": source, "replicas": 1,
            "engine_args": {"dtype": "float32", "max_num_seqs": 32, **engine,
                            "extra": {"enforce_eager": eager}},
            "resources": {"num_cpus": 0.1, "cpu_binding": ["0"]},
            "autoscaling": {"policy": "kv_cache", "min_replicas": 0, "max_replicas": 1, "idle_to_zero_s": 3,
                            "scale_down_cooldown_s": 0, "downscale_stabilization_s": 0, "decision_period_s": 0.5,
                            "metrics_interval_s": 0.5, "hold_timeout_s": 600}}


@dataclass
class Trial:
    """One cold start: fleetserve's phases, or bare vLLM's start (phases it has no equivalent of stay None)."""

    system: str
    variant: str
    # Request (fleetserve) or process start (bare vLLM) to the first SSE event.
    first_token_s: float
    weights_s: float | None
    actor_start_s: float | None = None
    model_files_s: float | None = None
    engine_init_s: float | None = None
    ready_to_first_token_s: float | None = None
    # fleetserve: vLLM's OpenAI app built (overlaps ready_to_first_token_s). Bare: process start to /health.
    app_s: float | None = None
    ready_s: float | None = None


def first_event_s(url: str, model: str, sent: float) -> float:
    """Streams one completion; seconds from ``sent`` (time.time()) to its first SSE data line."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "model": model},
                      timeout=httpx.Timeout(900.0, connect=10.0)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:500]}")
        first = None
        for line in response.iter_lines():  # read to the end: the request ends before the pool idles
            if first is None and line.startswith("data:"):
                first = time.time() - sent
    if first is None:
        raise RuntimeError("the stream ended without an event")
    return first


class LogTail:
    """New lines of a set of log files since the previous read (to find one engine's weights line)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.offsets: dict[Path, int] = {}
        self.read()

    def read(self) -> str:
        text = []
        for path in sorted(Path("/").glob(self.pattern.lstrip("/"))):
            with path.open("rb") as file:
                file.seek(self.offsets.get(path, 0))
                text.append(file.read().decode(errors="replace"))
                self.offsets[path] = file.tell()
        return "".join(text)


def weights_in(text: str) -> float | None:
    found = WEIGHTS_LINE.findall(text)
    return float(found[-1]) if found else None


def samples(url: str) -> list:
    """Every sample of the platform's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def scrape_startup(url: str, model: str, timeout_s: float = 10.0) -> tuple[float, dict[str, float]]:
    """(replica start time, {phase: seconds}) of the model's one replica, from the platform's /metrics (a
    replica publishes every second, so the app phase can reach it just after the first token)."""
    deadline = time.monotonic() + timeout_s
    while True:
        mine = [sample for sample in samples(url) if sample.labels.get("model_name") == model]
        start = next((s.value for s in mine if s.name == "fleetserve_replica_start_time_seconds"), None)
        phases = {s.labels["phase"]: s.value for s in mine if s.name == "fleetserve_replica_startup_seconds"}
        if start is not None and set(phases) == {phase.value for phase in StartupPhase}:
            return start, phases
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model}: no full startup report in {timeout_s} s ({start}, {phases})")
        time.sleep(0.5)


def wait_at_zero(url: str, model: ModelConfig) -> None:
    """Until Serve runs no replica of the model and the ingress sees none."""
    from ray import serve

    from fleetserve.deployments.serve_options import deployment_name

    deployment = deployment_name(model)
    deadline = time.monotonic() + ZERO_TIMEOUT_S
    while time.monotonic() < deadline:
        states = serve.status().applications[APP].deployments[deployment].replica_states
        reporting = sum(sample.value for sample in samples(url) if sample.name == "fleetserve_replicas"
                        and sample.labels.get("model") == model.name)
        if not any(states.values()) and reporting == 0:
            time.sleep(2)  # the ingress's load readings catch up
            return
        time.sleep(0.5)
    raise RuntimeError(f"{model.name} did not reach zero replicas in {ZERO_TIMEOUT_S} s")


def fleetserve_trials(variants: list[str], trials: int, out: Path) -> list[Trial]:
    import ray
    from ray import serve

    from fleetserve.deployments.builders import build_app

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = parse_config({"models": [model_entry(variant) for variant in variants]})
    ray.init(include_dashboard=False, log_to_driver=False)
    # vLLM logs to stdout: the replica worker's .out file, which its engine processes inherit.
    logs = LogTail(f"{ray._private.worker._global_node.get_session_dir_path()}/logs/worker-*.out")
    results = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP, route_prefix="/")
        for variant in variants:
            for trial in range(trials):
                wait_at_zero(url, config.model(variant))
                logs.read()
                sent = time.time()
                first = first_event_s(url, variant, sent)
                started_at, phases = scrape_startup(url, variant)
                weights = weights_in(logs.read())
                actor = started_at - sent
                results.append(Trial(
                    "fleetserve", variant, first, weights, actor_start_s=actor,
                    model_files_s=phases["model_files"], engine_init_s=phases["engine"] - (weights or 0.0),
                    ready_to_first_token_s=first - actor - phases["model_files"] - phases["engine"],
                    app_s=phases["app"]))
                print(f"fleetserve {variant} #{trial + 1}: first token {first:.1f} s (actor {actor:.1f}, engine "
                      f"{phases['engine']:.1f}, weights {weights}, app {phases['app']:.1f})", flush=True)
                save(results, out)
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def bare_trials(variants: list[str], trials: int, out: Path, previous: list[Trial]) -> list[Trial]:
    from fleetserve.platform.openai_app import vllm_serve_command

    results = list(previous)
    for variant in variants:
        model = parse_config({"models": [model_entry(variant)]}).model(variant)
        for trial in range(trials):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log_path = out / f"vllm-{variant}-{trial}.log"
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
            sent = time.time()
            with log_path.open("w") as log:
                process = subprocess.Popen(vllm_serve_command(model, port=port), stdout=log,
                                           stderr=subprocess.STDOUT, env=env)
            try:
                wait_until_ready(url, process=process, poll_s=0.1)
                ready = time.time() - sent
                first = first_event_s(url, variant, sent)
            finally:
                process.terminate()
                process.wait(timeout=60)
            weights = weights_in(log_path.read_text())
            results.append(Trial("vllm serve", variant, first, weights, ready_s=ready))
            print(f"vllm serve {variant} #{trial + 1}: ready {ready:.1f} s, first token {first:.1f} s, "
                  f"weights {weights}", flush=True)
            save(results, out)
    return results


def save(results: list[Trial], out: Path) -> None:
    (out / "trials.json").write_text(json.dumps([asdict(trial) for trial in results], indent=1))


def summarize(results: list[Trial]) -> list[dict]:
    """Median and p99 of each measured field per (system, variant)."""
    rows = []
    for key in dict.fromkeys((trial.system, trial.variant) for trial in results):
        group = [trial for trial in results if (trial.system, trial.variant) == key]
        row = {"system": key[0], "variant": key[1], "trials": len(group)}
        for name in ("first_token_s", "ready_s", "weights_s", "app_s", *PHASES):
            values = [getattr(trial, name) for trial in group if getattr(trial, name) is not None]
            if values:
                row[name] = {"p50": float(np.median(values)), "p99": float(np.percentile(values, 99))}
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4))
    labels = [f"{row['system']}\n{row['variant']}" for row in rows]
    bottom = np.zeros(len(rows))
    for phase in PHASES:
        heights = np.array([row.get(phase, {}).get("p50", 0.0) for row in rows])
        axis.bar(labels, heights, bottom=bottom, label=phase.removesuffix("_s").replace("_", " "))
        bottom += heights
    bare = np.array([row["first_token_s"]["p50"] if row["system"] != "fleetserve" else 0.0 for row in rows])
    axis.bar(labels, bare, label="vllm serve: process start to first token", color="grey")
    axis.set_ylabel("median seconds")
    axis.set_title("Cold start to first token, by phase (medians)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["tiny", "smollm2", "smollm2-compiled"])
    parser.add_argument("--systems", nargs="+", choices=["fleetserve", "vllm"], default=["fleetserve", "vllm"])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cold-start")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = fleetserve_trials(args.variants, args.trials, args.out) if "fleetserve" in args.systems else []
    if "vllm" in args.systems:
        results = bare_trials(args.variants, args.trials, args.out, results)
    rows = summarize(results)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "cold-start.png")
    print(f"\n{args.trials} cold starts each, one engine on core 0; seconds, p50 / p99\n")
    columns = ("first_token_s", "ready_s", *PHASES, "app_s")
    print("| system | variant | " + " | ".join(c.removesuffix("_s").replace("_", " ") for c in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]['p50']:.1f} / {row[c]['p99']:.1f}" if c in row else "-" for c in columns]
        print(f"| {row['system']} | {row['variant']} | " + " | ".join(cells) + " |")
    print(f"\nplot: {args.out / 'cold-start.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
