"""Whether a platform config's replicas fit a cluster's nodes, checked before anything is deployed.

Ray leaves a replica that fits no node pending for ever, with no error reaching the user; a model whose
``custom_resources`` name a MIG profile that no node offers would look like a slow start. This module
compares each replica's ask with what every node offers, in Ray's resource names, and says which
resource is missing. It imports no Ray: the serving layer hands it the nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleetserve.platform.config import ModelConfig, PlatformConfig

# Ray's resource for a node's accelerator type is "accelerator_type:<type>", offered as 1.0; an actor
# asking for accelerator_type asks for this small amount of it.
ACCELERATOR_TYPE_PREFIX = "accelerator_type:"
ACCELERATOR_TYPE_ASK = 0.001
# Resources every node offers and no replica asks for by name (memory, the object store, node ids).
_INTERNAL_PREFIXES = ("node:", "memory", "object_store_memory")


@dataclass(frozen=True)
class NodeOffer:
    """One alive node of the cluster and what it offers in all (free or not)."""

    # Ray's node id (hex).
    node_id: str
    # Ray resource name -> total amount on this node, e.g. {"CPU": 8, "GPU": 1, "mig-3g.71gb": 2}.
    resources: dict[str, float]


@dataclass(frozen=True)
class PoolDemand:
    """What one pool of a model (an engine deployment) asks of the cluster."""

    # The model's name in the config.
    model: str
    # The pool: colocated, prefill or decode.
    pool: str
    # Replicas Serve starts at once (initial, or min under autoscaling).
    num_replicas: int
    # Ray resource name -> amount, for one replica.
    per_replica: dict[str, float]


@dataclass
class PlacementReport:
    """The outcome of a placement check."""

    # Pools no node could host a single replica of, each with the sentence saying why.
    unplaceable: list[str] = field(default_factory=list)
    # Pools whose replicas, packed onto the nodes together with everyone else's, do not all fit at once:
    # those replicas stay pending until resources free up or nodes join.
    pending: list[str] = field(default_factory=list)
    # (model, pool) -> node ids that the packing put the pool's replicas on, one entry per replica.
    assignment: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    # What will run, but not as well as it could, each a sentence saying what to change.
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unplaceable


def pool_demands(config: PlatformConfig) -> list[PoolDemand]:
    """Every engine pool of the config, with its replicas' resource asks in Ray's names."""
    demands = []
    for model in config.models:
        for pool in model.pools():
            pool_model = model.pool_model(pool)
            demands.append(PoolDemand(model.name, pool, _num_replicas(pool_model), replica_resources(pool_model)))
    return demands


def unpinned_cpu_warning(config: PlatformConfig, num_nodes: int, num_local_cores: int) -> str | None:
    """On a cluster of several nodes, a warning naming the CPU pools whose cores the platform plans (no
    ``cpu_binding``): it plans them as if every engine shared this machine's cores, which on other nodes leaves
    cores idle or puts engines on the same ones."""
    if num_nodes <= 1:
        return None
    names = [model.name if pool == "colocated" else f"{model.name} ({pool})"
             for model in config.models for pool in model.pools()
             if model.pool_model(pool).resources.cpu_binding is None and not model.pool_model(pool).resources.num_gpus]
    if not names:
        return None
    return (f"{', '.join(names)}: CPU engines without resources.cpu_binding are pinned as if all ran on this "
            f"machine's {num_local_cores} cores, not on the cores of the {num_nodes} nodes they run on; set "
            f"cpu_binding per model (or per pool) for this cluster")


def _num_replicas(model: ModelConfig) -> int:
    if model.autoscaling is None:
        return model.replicas
    return min(max(model.replicas, model.autoscaling.min_replicas), model.autoscaling.max_replicas)


def replica_resources(model: ModelConfig) -> dict[str, float]:
    """One replica's ask, as Ray names it: CPU, GPU, custom resources, and the accelerator type."""
    resources = model.resources
    ask = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.custom_resources}
    if resources.accelerator_type:
        ask[ACCELERATOR_TYPE_PREFIX + resources.accelerator_type] = ACCELERATOR_TYPE_ASK
    return {name: amount for name, amount in ask.items() if amount > 0}


def check_placement(demands: list[PoolDemand], nodes: list[NodeOffer]) -> PlacementReport:
    """Checks that each pool's replica fits some node, then packs every replica onto the nodes.

    The packing is first fit by node order, largest asks first, as a rough stand-in for Ray's scheduler:
    a pool it cannot place in full is reported pending, never refused, since Ray may place differently and
    an autoscaling cluster may add nodes.
    """
    report = PlacementReport()
    free = {node.node_id: dict(node.resources) for node in nodes}
    placeable = []
    for demand in demands:
        why = _why_unplaceable(demand, nodes)
        if why is None:
            placeable.append(demand)
        else:
            report.unplaceable.append(why)
    for demand in sorted(placeable, key=lambda d: -sum(d.per_replica.values())):
        placed = report.assignment.setdefault((demand.model, demand.pool), [])
        for _ in range(demand.num_replicas):
            node_id = next((node_id for node_id, left in free.items() if _fits(demand.per_replica, left)), None)
            if node_id is None:
                break
            for name, amount in demand.per_replica.items():
                free[node_id][name] -= amount
            placed.append(node_id)
        if len(placed) < demand.num_replicas:
            report.pending.append(f"{_label(demand)}: {demand.num_replicas - len(placed)} of {demand.num_replicas} "
                                  f"replicas do not fit beside the others at once and wait for resources "
                                  f"({_describe(demand.per_replica)} each)")
    return report


def _fits(ask: dict[str, float], offer: dict[str, float]) -> bool:
    # Ray compares amounts in units of 1/10000; the tolerance keeps 0.1 + 0.2 from failing 0.3.
    return all(offer.get(name, 0.0) + 1e-9 >= amount for name, amount in ask.items())


def _why_unplaceable(demand: PoolDemand, nodes: list[NodeOffer]) -> str | None:
    """None if some node offers one replica's whole ask; else the sentence naming what is missing."""
    if any(_fits(demand.per_replica, node.resources) for node in nodes):
        return None
    offered = {name for node in nodes for name in node.resources}
    missing = sorted(name for name in demand.per_replica if name not in offered)
    if missing:
        reason = f"no node offers {', '.join(repr(name) for name in missing)}"
    else:
        most = {name: max(node.resources.get(name, 0.0) for node in nodes) for name in demand.per_replica}
        short = sorted(name for name, amount in demand.per_replica.items() if most[name] + 1e-9 < amount)
        reason = ("no node offers enough " + ", ".join(f"{name!r} (asks {_amount(demand.per_replica[name])}, "
                                                      f"the most on one node is {_amount(most[name])})"
                                                      for name in short)
                  if short else "no single node offers all of it together")
    return (f"{_label(demand)}: one replica asks for {_describe(demand.per_replica)}, and {reason}. "
            f"Nodes: {_describe_nodes(nodes)}")


def _label(demand: PoolDemand) -> str:
    return f"model {demand.model!r}" + (f" ({demand.pool} pool)" if demand.pool != "colocated" else "")


def _amount(value: float) -> str:
    return str(int(value)) if math.isclose(value, round(value)) else f"{value:g}"


def _describe(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {_amount(amount)}" for name, amount in sorted(resources.items())) + "}"


def _describe_nodes(nodes: list[NodeOffer]) -> str:
    if not nodes:
        return "none alive"
    return "; ".join(f"{node.node_id[:8]} {_describe(offered_resources(node.resources))}" for node in nodes)


def offered_resources(resources: dict[str, float]) -> dict[str, float]:
    """A node's resources without Ray's internal ones (memory, object store, node ids)."""
    return {name: amount for name, amount in resources.items() if not name.startswith(_INTERNAL_PREFIXES)}
