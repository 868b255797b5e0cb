"""Runs the platform on a Ray cluster: one started in this process (``fleetserve serve``, ``make serve``), or
a running cluster joined as a driver (``fleetserve serve --address``, ``fleetserve apply``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.exceptions import RayServeException

# The Serve application's name; the chart's RayService and `fleetserve status` use the same.
APP_NAME = "fleetserve"


class ClusterError(RuntimeError):
    """No Ray cluster to join; the message says where it looked."""


def join_cluster(address: str = "auto", verbose: bool = False) -> None:
    """Joins the running Ray cluster at ``address`` (``auto``: the one on this machine) as a driver.

    Raises:
        ClusterError: nothing runs at ``address``.
    """
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=verbose, configure_logging=verbose)
    except ConnectionError as error:
        raise ClusterError(f"no Ray cluster at {address!r} ({error}); start one with `ray start --head`, or "
                           f"the platform with `fleetserve serve`") from None


@dataclass
class RaySession:
    """The Ray cluster the platform runs on while ``start_ray``'s block runs."""

    # The cluster joined; None: one started in this process.
    address: str | None
    # Whether this session deployed the platform's application, and so deletes it on leaving.
    deployed: bool = False

    def deploy(self, application: Application, host: str, port: int, proxy_location: str = "EveryNode") -> None:
        """Starts Serve's HTTP proxies on ``host:port`` (on the nodes ``proxy_location`` names) and deploys the
        application at ``/``; returns once every deployment is running."""
        serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
        self.deployed = True
        serve.run(application, name=APP_NAME, route_prefix="/")


def _serves_platform() -> bool:
    """Whether the connected cluster's Serve runs the platform's application."""
    try:
        return APP_NAME in serve.status().applications
    except RayServeException:  # Serve is not running there
        return False


@contextmanager
def start_ray(verbose: bool = False, address: str | None = None,
              runtime_env: dict[str, Any] | None = None) -> Iterator[RaySession]:
    """A Ray cluster for as long as the block runs.

    Args:
        verbose: stream Ray's and the engines' logs to this terminal.
        address: join the cluster there and, on leaving, delete the platform's application if this session
            deployed it, leaving the cluster running; None starts a cluster in this process and shuts it and
            Serve down after.

    Raises:
        ClusterError: nothing runs at ``address``, or the cluster there already serves the platform (a
            second ``serve`` would replace it: ``fleetserve apply`` is the way to change it).
    """
    if address is None:
        ray.init(include_dashboard=False, log_to_driver=verbose, configure_logging=verbose, runtime_env=runtime_env)
    else:
        join_cluster(address, verbose)
        if _serves_platform():
            ray.shutdown()
            raise ClusterError(f"the Ray cluster at {address!r} already serves the platform (Serve application "
                               f"{APP_NAME!r}); change it with `fleetserve apply CONFIG --address {address}`")
    session = RaySession(address)
    try:
        yield session
    finally:
        if address is None:
            serve.shutdown()
        elif session.deployed and _serves_platform():
            serve.delete(APP_NAME)
        ray.shutdown()
