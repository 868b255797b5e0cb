"""The cluster's alive nodes, read from Ray, checked against a platform config before it is deployed."""

from __future__ import annotations

import os

import ray

from fleetserve.platform.config import PlatformConfig
from fleetserve.platform.placement import (NodeOffer, PlacementReport, check_placement, pool_demands,
                                           unpinned_cpu_warning)


class PlacementError(RuntimeError):
    """Some model's replica fits no node of the cluster; the message names the missing resources."""


def cluster_nodes() -> list[NodeOffer]:
    """The alive nodes of the Ray cluster this process is connected to, with their total resources."""
    return [NodeOffer(node["NodeID"], dict(node["Resources"])) for node in ray.nodes() if node["Alive"]]


def require_placement(config: PlatformConfig) -> PlacementReport:
    """Checks the config against the connected cluster's nodes.

    Returns:
        The report, whose ``pending`` lists the pools that will wait for resources, and ``warnings`` what runs
        less well than it could (CPU engines pinned by this machine's cores on a cluster of several nodes).

    Raises:
        PlacementError: a pool's replica fits no node.
    """
    nodes = cluster_nodes()
    report = check_placement(pool_demands(config), nodes)
    if not report.ok:
        raise PlacementError("\n".join(report.unplaceable))
    warning = unpinned_cpu_warning(config, len(nodes), len(os.sched_getaffinity(0)))
    if warning is not None:
        report.warnings.append(warning)
    return report
