"""Shared fixtures. One Ray cluster and one Serve app with two real engines serve the whole suite."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from fleetserve.loadtest.baseline import free_port
from fleetserve.platform.config import PlatformConfig, parse_config
from fleetserve.platform.shm import remove_orphaned_segments
from fleetserve.platform.stats import EngineStats
from factories import TEST_EXTRA_ARGS, model_entry, synthetic_correctness

MiB = 1024 * 1024


def pytest_sessionstart(session: pytest.Session) -> None:
    # Earlier runs may have left vLLM segments behind; they would pile up on CI machines.
    remove_orphaned_segments()


# The suite's shared app: the tiny model on core 0, SmolLM2 on core 1, and the routed name `auto`
# (a classifier trained on synthetic_correctness(), calibrated to send half its prompts to smollm2).
SERVED_MODELS = [
    {**model_entry("tiny"), "resources": {"num_cpus": 0.1, "cpu_binding": ["0"]},
     "cost_per_million_input_tokens": 0.1, "cost_per_million_output_tokens": 0.2},
    {**model_entry("smollm2", "smollm2-135m-instruct", max_model_len=2048, kv_cache_memory_bytes=128 * MiB),
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
        """Polls the engine until nothing runs or waits; returns the idle stats (or the last seen)."""
        deadline = time.monotonic() + timeout_s
        stats = self.stats(model)
        while time.monotonic() < deadline:
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
                return stats
            time.sleep(0.2)
            stats = self.stats(model)
        return stats


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def routing_checkpoint(tmp_path_factory) -> Any:
    """A hashing-embedder classifier trained on synthetic_correctness(), calibrated at strong_fraction 0.5."""
    from fleetserve.router.embedders import make_embedder
    from fleetserve.router.quality_router import train_router

    data = synthetic_correctness()
    router = train_router("classifier", data, make_embedder("hashing-256"))
    router.calibrate(data.prompts, 0.5, {"reference": "synthetic_correctness()"})
    return router.save(tmp_path_factory.mktemp("router") / "classifier")


@pytest.fixture(scope="session")
def served(ray_cluster, routing_checkpoint) -> Served:
    from ray import serve

    from fleetserve.deployments.builders import build_app

    config = parse_config({"models": SERVED_MODELS, "model_routing": {
        "checkpoints": {"classifier": str(routing_checkpoint)}, "tiers": ["tiny", "smollm2"],
        "routes": [{"name": "auto", "router": "classifier", "strong_fraction": 0.5}]}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="fleetserve", route_prefix="/")
    handles = {model.name: serve.get_deployment_handle(model.deployment_name, "fleetserve")
               for model in config.models}
    yield Served(base_url=f"http://127.0.0.1:{port}", config=config, handles=handles)
    serve.shutdown()


class FakeTokenizer:
    """Whitespace tokenizer over a fixed vocabulary: token id i is the word ``w{i}``."""

    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(word) % self.vocab_size for word in text.split()]


class FakeEngine:
    """Injected in place of ``Engine`` for serving-logic tests: emits ``w0 w1 ...`` on a fixed schedule.

    ``first_token_s`` is the delay before the first token, ``token_interval_s`` between tokens.
    """

    first_token_s = 0.0
    token_interval_s = 0.0
    max_model_len = 64

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.num_finished = 0

    @classmethod
    def create(cls, model, model_path, cpu_binding=None, stats_listeners=()) -> FakeEngine:
        return cls()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def render_chat(self, messages) -> list[int]:
        return self.encode(" ".join(message["content"] for message in messages))

    async def generate(self, prompt_ids, options, request_id):
        import asyncio

        from fleetserve.platform.engine import Engine, GenerationDelta

        max_tokens = Engine.check_length(self, len(prompt_ids), options.max_tokens)
        self.running.add(request_id)
        finished = False
        try:
            await asyncio.sleep(self.first_token_s)
            for index in range(max_tokens):
                if index:
                    await asyncio.sleep(self.token_interval_s)
                word = f"w{index}"
                if word in options.stop:
                    finished = True
                    yield GenerationDelta("", [], "stop", word, len(prompt_ids))
                    return
                last = index == max_tokens - 1
                finished = last
                yield GenerationDelta(f" {word}" if index else word, [index], "length" if last else None,
                                      None, len(prompt_ids))
        finally:
            self.running.discard(request_id)
            self.num_finished += 1
            if not finished:
                self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_finished=self.num_finished)

    async def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


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
    handles = {model.name: serve.get_deployment_handle(model.deployment_name, "routing") for model in config.models}
    yield Served(base_url=f"{served.base_url}/routing", config=config, handles=handles)
    serve.delete("routing")


@pytest.fixture(scope="module")
def bare_vllm():
    """Bare vLLM's OpenAI server with the suite's tiny model config (same engine args), on core 1."""
    import os
    import subprocess

    from fleetserve.loadtest.baseline import bare_vllm_command, wait_until_ready

    port = free_port()
    model = SERVED_CONFIG.model("tiny")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"}
    process = subprocess.Popen(bare_vllm_command(model, port=port), env=env, stdout=subprocess.DEVNULL,
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
