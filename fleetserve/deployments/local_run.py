"""Runs the platform on a Ray cluster: one started in this process (``fleetserve serve``, ``make serve``), or
a running cluster joined as a driver (``fleetserve serve --address``, ``fleetserve apply``)."""

from __future__ import annotations

import re
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


# Lines of a failed replica's traceback kept in a AppStartError: the exception and its message.
MAX_CAUSE_LINES = 8
# A traceback line that starts an exception's message ("ValueError: ...", "pydantic_core...ValidationError: ...").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:")


class ClusterError(RuntimeError):
    """No Ray cluster to join; the message says where it looked."""


class AppStartError(RuntimeError):
    """The application's deployments did not start; the message names each failed one and why."""


def failure_cause(message: str) -> str:
    """The last exception in a Serve deployment's status message (which ends with the failed replica's whole
    traceback): its line and the lines after it, at most MAX_CAUSE_LINES."""
    lines = [line.rstrip() for line in message.splitlines() if line.strip()]
    starts = [index for index, line in enumerate(lines) if _EXCEPTION_LINE.match(line.strip())]
    if not starts:
        return "\n".join(lines[-MAX_CAUSE_LINES:])
    return "\n".join(line.strip() for line in lines[starts[-1]:starts[-1] + MAX_CAUSE_LINES])


def deploy_failures(app_name: str = APP_NAME) -> list[str]:
    """Each deployment of ``app_name`` that failed to start, as ``"<deployment>: <cause>"``."""
    try:
        application = serve.status().applications.get(app_name)
    except RayServeException:
        return []
    if application is None:
        return []
    return [f"{name}: {failure_cause(deployment.message)}"
            for name, deployment in application.deployments.items()
            if deployment.status in ("DEPLOY_FAILED", "UNHEALTHY") and deployment.message]


def run_application(application: Application, app_name: str = APP_NAME, route_prefix: str = "/") -> None:
    """``serve.run``, returning once every deployment runs.

    Raises:
        AppStartError: a deployment failed to start (say, an engine replica's constructor raised); the message
            carries each failed deployment's own error, which Serve reports only as "Failed to update".
    """
    try:
        serve.run(application, name=app_name, route_prefix=route_prefix)
    except RuntimeError as error:
        failures = deploy_failures(app_name)
        if not failures:
            raise
        raise AppStartError(f"{app_name} did not start:\n" + "\n".join(failures)) from error


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
        run_application(application)


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
