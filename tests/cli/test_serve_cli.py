"""`fleetserve serve` as a user runs it: starts, answers, and stops cleanly on Ctrl-C (SIGINT)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fleetserve.loadtest.local_server import free_port

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:8000/v1"


def readme_example() -> tuple[str, str]:
    """The README's first Python example and what its comment says it prints."""
    example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return example, re.search(r"print\(.*\)\s+# (.+)", example).group(1)


@pytest.mark.slow
def test_serve_without_a_config_answers_the_readme_example_and_stops_on_sigint(tmp_path):
    # `make serve`'s command: the embedded default model, on a cluster of its own.
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    log = (tmp_path / "serve.log").open("w+")
    process = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=tmp_path)
    try:
        ready = process.stdout.readline()  # the CLI prints READY only once the app answers
        assert ready.strip() == f"READY http://127.0.0.1:{port}/v1", (tmp_path / "serve.log").read_text()[-3000:]
        example, printed = readme_example()
        assert README_URL in example
        done = subprocess.run([sys.executable, "-c", example.replace(README_URL, f"http://127.0.0.1:{port}/v1")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == printed
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
    log.seek(0)
    assert "stopped cleanly" in log.read()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.mark.slow
def test_sigint_during_start_up_stops_it(tmp_path):
    import time

    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    log_path = tmp_path / "serve.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetserve.cli", "serve", str(ROOT / "examples" / "tiny.yaml"), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "Started Serve" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "Started Serve" in log_path.read_text(), log_path.read_text()[-3000:]
        process.send_signal(signal.SIGINT)  # the engines are still starting
        # Before, the signal waited for the start-up to finish, and the platform then served until a second one.
        assert process.wait(timeout=120) == 130
    finally:
        if process.poll() is None:
            process.kill()
    log = log_path.read_text()
    assert "stopping during start-up" in log and "stopped before the platform was ready" in log
    assert "READY" not in process.stdout.read()


def test_serve_rejects_a_bad_config_with_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    source: tiny-random-llama\n    replicas: -1\n")
    done = subprocess.run([sys.executable, "-m", "fleetserve.cli", "serve", str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "models.0.replicas: Input should be greater than or equal to 0 (got -1)" in done.stderr


def test_serve_refuses_a_taken_port_before_starting_anything():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "fleetserve.cli", "serve", str(ROOT / "examples" / "tiny.yaml"),
                               "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"127.0.0.1:{port} is taken" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr and "Ray" not in done.stderr  # refused before Ray started
