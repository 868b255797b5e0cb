"""How a running platform's Serve applications were built, which a change to it must repeat."""

from __future__ import annotations

from enum import Enum


class AppLayout(str, Enum):
    """The shape of a running platform, as its ingress reports it (``fleetserve apply`` reads it)."""

    # One application; `fleetserve serve` resolved every model's source on its own machine, which was the whole
    # cluster (it started it), and handed the replicas the folder.
    DRIVER_SOURCES = "driver_sources"
    # One application on a cluster that was joined (`--address`, `serve run`): its nodes need not share the
    # driver's files, so each engine replica resolves its model's source on its own node.
    REPLICA_SOURCES = "replica_sources"
    # The chart's applications (serveConfigV2): the front door, the hub, one per model. Changed by
    # `helm upgrade`, which rewrites them all; a single application applied over them would duplicate engines.
    PER_MODEL_APPS = "per_model_apps"
