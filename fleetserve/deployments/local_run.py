"""Runs the platform on a Ray cluster started in this process (``fleetserve serve``, ``make serve``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray import serve
from ray.serve import Application

# The Serve application's name; the chart's RayService and `fleetserve status` use the same.
APP_NAME = "fleetserve"


@contextmanager
def start_ray(verbose: bool = False) -> Iterator[None]:
    """A local Ray cluster for as long as the block runs; Serve is shut down with it."""
    ray.init(include_dashboard=False, log_to_driver=verbose, configure_logging=verbose)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(application: Application, host: str, port: int) -> None:
    """Starts Serve's HTTP proxy on ``host:port`` and deploys the application at ``/``; returns once
    every deployment is running."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(application, name=APP_NAME, route_prefix="/")
