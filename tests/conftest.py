"""Shared fixtures. One Ray cluster and one Serve app with two real engines serve the whole suite."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetserve.loadtest.local_server import free_port
from fleetserve.platform.config import PlatformConfig, parse_config
from fleetserve.platform.shm import remove_orphaned_segments
from fleetserve.platform.stats import EngineStats
from factories import TEST_EXTRA_ARGS, model_entry, synthetic_correctness
from fake_engine import FakeEngine

MiB = 1024 * 1024

# vLLM's CPU platform runs each engine's worker in a third process, which imports vLLM again (~8 s of
# these 2 cores per engine start; the suite starts about 50). With multiprocessing off it keeps the worker
# in the engine-core process (vLLM's default on GPUs) and the offline references run in-process (77 s -> 22 s
# for the suite's two models, same greedy output). Set before Ray starts, so every replica, `ray start`
# node and CLI subprocess inherits it. Production keeps vLLM's default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# Fixtures that start real engines or servers (Ray, vLLM): a test that uses one must be marked slow,
# so `make test-fast` (-m "not slow") never starts an engine.
REAL_ENGINE_FIXTURES = frozenset({"ray_cluster", "served", "two_replica_app", "bare_vllm", "real_engine"})


def pytest_sessionstart(session: pytest.Session) -> None:
    # Earlier runs may have left vLLM segments behind; they would pile up on CI machines.
    remove_orphaned_segments()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items
                if REAL_ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("tests that start real engines must be marked slow:\n  " + "\n  ".join(unmarked))


# The suite's shared app: the tiny model on core 0, SmolLM2 on core 1, and the routed name `auto`
# (a classifier trained on synthetic_correctness(), calibrated to send half its prompts to smollm2), and the Batch API.
SERVED_MODELS = [
    {**model_entry("tiny"), "resources": {"num_cpus": 0.1, "cpu_binding": ["0"]},
     "cost_per_million_input_tokens": 0.1, "cost_per_million_output_tokens": 0.2},
    # Compact JSON under structured outputs: a 135M model given free whitespace pads its JSON until max_tokens.
    {**model_entry("smollm2", "smollm2-135m-instruct", max_model_len=2048, kv_cache_memory_bytes=128 * MiB,
                   extra={"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}),
     "resources": {"num_cpus": 0.1, "cpu_binding": ["1"]},
     "cost_per_million_input_tokens": 1.0, "cost_per_million_output_tokens": 2.0},
]
SERVED_CONFIG = parse_config({"models": SERVED_MODELS})


@dataclass
class Served:
    """The running app: where it listens and how to read its engines' stats."""

    base_url: str
    config: PlatformConfig
    handles: dict[str, Any]

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def stats(self, model: str) -> EngineStats:
        return self.handles[model].stats.remote().result()

    def wait_idle(self, model: str, timeout_s: float = 30.0) -> EngineStats:
        """Polls the engine until nothing runs or waits and its counters have settled; returns those stats
        (or the last seen).

        Settled means two polls 0.2 s apart agree on the finished-request and generated-token counts: a
        request of an earlier test can leave the scheduler before its finish reaches the stat logger.
        """
        deadline = time.monotonic() + timeout_s
        previous, stats = None, self.stats(model)
        while time.monotonic() < deadline:
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
            if idle and previous is not None and (previous.num_finished, previous.num_generation_tokens) == (
                    stats.num_finished, stats.num_generation_tokens):
                return stats
            time.sleep(0.2)
            previous, stats = (stats if idle else None), self.stats(model)
        return stats


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from fleetserve.deployments.serve_options import job_runtime_env
    from fleetserve.platform.config import ServerConfig

    # As `fleetserve serve` starts its cluster; FLEETSERVE_TEST_FAST_PATH=1 puts every app the suite serves on
    # Serve's fast path (the job's runtime_env reaches Serve's controller, proxies and replicas).
    server = ServerConfig(serve_fast_path=os.environ.get("FLEETSERVE_TEST_FAST_PATH") == "1")
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=4, runtime_env=job_runtime_env(server))
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def routing_checkpoint(tmp_path_factory) -> Any:
    """A hashing-embedder classifier trained on synthetic_correctness(), calibrated at strong_fraction 0.5."""
    from fleetserve.router.model.embedders import make_embedder
    from fleetserve.router.model.quality_router import train_router

    data = synthetic_correctness()
    router = train_router("classifier", data, make_embedder("hashing-256"))
    router.calibrate(data.prompts, 0.5, {"reference": "synthetic_correctness()"})
    return router.save(tmp_path_factory.mktemp("router") / "classifier")


@pytest.fixture(scope="session")
def traffic_dir(tmp_path_factory) -> Path:
    """Where the suite's app records routed prompts (auth is off, so as tenant "anonymous")."""
    return tmp_path_factory.mktemp("traffic")


@pytest.fixture(scope="session")
def served(ray_cluster, routing_checkpoint, traffic_dir, tmp_path_factory) -> Served:
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.deployments.serve_options import deployment_name

    port = free_port()
    # The batch service sends its batches' requests to server.port, where this app listens.
    config = parse_config({"models": SERVED_MODELS, "model_routing": {
        "checkpoints": {"classifier": str(routing_checkpoint)}, "tiers": ["tiny", "smollm2"],
        "routes": [{"name": "auto", "router": "classifier", "strong_fraction": 0.5}],
        "recording": {"directory": str(traffic_dir), "anonymous": True}},
        "server": {"port": port}, "batches": {"folder": str(tmp_path_factory.mktemp("batches"))}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="fleetserve", route_prefix="/")
    handles = {model.name: serve.get_deployment_handle(deployment_name(model), "fleetserve")
               for model in config.models}
    yield Served(base_url=f"http://127.0.0.1:{port}", config=config, handles=handles)
    serve.shutdown()


@pytest.fixture
def fake_engine_cls():
    return FakeEngine


class LoopbackServer:
    """Runs an ASGI app under uvicorn on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("loopback server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture
def loopback_server():
    return LoopbackServer


@pytest.fixture(scope="session")
def two_replica_app(served) -> Served:
    """A second app on the same Serve instance: the tiny model twice, each with 2 replicas (one per core),
    under fleetserve's cache-aware router and under Serve's default router."""
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.deployments.serve_options import deployment_name

    two_replicas = {"replicas": 2, "resources": {"num_cpus": 0.1, "cpu_binding": ["0", "1"]},
                    "engine_args": {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 64 * MiB,
                                    "extra": TEST_EXTRA_ARGS}}
    config = parse_config({"models": [
        {"name": "tiny-cache-aware", "source": "tiny-random-llama", **two_replicas,
         "routing": {"policy": "cache_aware"}, "cost_per_million_input_tokens": 1.0,
         "cost_per_million_output_tokens": 2.0},
        {"name": "tiny-default", "source": "tiny-random-llama", **two_replicas, "routing": {"policy": "power_of_two"}},
    ]})
    serve.run(build_app(config), name="routing", route_prefix="/routing")
    handles = {model.name: serve.get_deployment_handle(deployment_name(model), "routing") for model in config.models}
    yield Served(base_url=f"{served.base_url}/routing", config=config, handles=handles)
    serve.delete("routing")


@pytest.fixture(scope="module")
def bare_vllm():
    """Bare vLLM's OpenAI server with the suite's tiny model config (same engine args), on core 1."""
    import os
    import subprocess

    from fleetserve.loadtest.local_server import wait_until_ready
    from fleetserve.platform.openai_app import vllm_serve_command

    port = free_port()
    model = SERVED_CONFIG.model("tiny")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"}
    process = subprocess.Popen(vllm_serve_command(model, port=port), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process=process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
