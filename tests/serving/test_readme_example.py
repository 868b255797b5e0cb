"""The README's first example, run as written against the embedded default model (what `make serve` serves): it
prints what the README's comment says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_URL = "http://127.0.0.1:8000/v1"


@pytest.fixture(scope="module")
def default_app(served) -> str:
    from ray import serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.config import default_config

    config = default_config()
    config.models[0].resources.num_cpus = 0.1
    serve.run(build_app(config), name="readme", route_prefix="/readme")
    yield f"{served.base_url}/readme/v1"
    serve.delete("readme")


def test_the_readme_example_prints_what_it_says(default_app):
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    printed = re.search(r"print\(.*\)\s+# (.+)", example).group(1)
    assert DEFAULT_URL in example
    done = subprocess.run([sys.executable, "-c", example.replace(DEFAULT_URL, default_app)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == printed
