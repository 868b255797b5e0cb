"""Placement check: which replicas fit which nodes, and the error that names a missing resource."""

from __future__ import annotations

from typing import Any

from factories import model_entry
from fleetserve.platform.config import parse_config
from fleetserve.platform.placement import (NodeOffer, check_placement, pool_demands, replica_resources,
                                           unpinned_cpu_warning)

HEAD = NodeOffer("aaaaaaaa00", {"CPU": 2.0, "memory": 8e9, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0})
SMALL_SLICES = NodeOffer("bbbbbbbb00", {"CPU": 1.0, "mig-1g.18gb": 2.0, "accelerator_type:H200": 1.0})
BIG_SLICE = NodeOffer("cccccccc00", {"CPU": 1.0, "mig-1g.18gb": 1.0, "mig-3g.71gb": 1.0})


def config(*models: dict[str, Any]) -> Any:
    return parse_config({"models": list(models)})


def on_slice(name: str, slice_name: str, replicas: int = 1, num_cpus: float = 0.1, **resources: Any) -> dict:
    return {**model_entry(name), "replicas": replicas,
            "resources": {"num_cpus": num_cpus, "custom_resources": {slice_name: 1}, **resources}}


def test_replica_resources_use_rays_names():
    model = config(on_slice("a", "mig-3g.71gb", num_cpus=0.5, accelerator_type="H200")).models[0]
    # num_gpus 0 is left out: Ray asks for nothing of a resource at 0.
    assert replica_resources(model) == {"CPU": 0.5, "mig-3g.71gb": 1, "accelerator_type:H200": 0.001}


def test_each_pool_lands_on_a_node_offering_its_slice():
    demands = pool_demands(config(on_slice("small", "mig-1g.18gb", replicas=2), on_slice("big", "mig-3g.71gb")))
    report = check_placement(demands, [HEAD, SMALL_SLICES, BIG_SLICE])
    assert report.ok and report.pending == []
    # big (largest ask, packed first) takes the only 3g slice; both small replicas fit the 1g node.
    assert report.assignment == {("big", "colocated"): ["cccccccc00"],
                                 ("small", "colocated"): ["bbbbbbbb00", "bbbbbbbb00"]}


def test_a_slice_no_node_offers_is_named():
    report = check_placement(pool_demands(config(on_slice("huge", "mig-7g.141gb"))), [HEAD, SMALL_SLICES, BIG_SLICE])
    assert not report.ok
    assert report.unplaceable == [
        "model 'huge': one replica asks for {CPU: 0.1, mig-7g.141gb: 1}, and no node offers 'mig-7g.141gb'. "
        "Nodes: aaaaaaaa {CPU: 2}; bbbbbbbb {CPU: 1, accelerator_type:H200: 1, mig-1g.18gb: 2}; "
        "cccccccc {CPU: 1, mig-1g.18gb: 1, mig-3g.71gb: 1}"]


def test_an_ask_larger_than_any_node_names_the_shortfall():
    model = {**model_entry("wide"), "resources": {"num_cpus": 4}}
    report = check_placement(pool_demands(config(model)), [HEAD, SMALL_SLICES])
    assert report.unplaceable[0].startswith(
        "model 'wide': one replica asks for {CPU: 4}, and no node offers enough 'CPU' (asks 4, the most on one "
        "node is 2).")


def test_resources_offered_only_on_different_nodes_do_not_fit():
    # 1g and 3g slices exist, but on no node together.
    model = {**model_entry("both"), "resources": {"num_cpus": 0, "custom_resources": {"mig-3g.71gb": 1,
                                                                                     "accelerator_type:H200": 1}}}
    report = check_placement(pool_demands(config(model)), [SMALL_SLICES, BIG_SLICE])
    assert "no single node offers all of it together" in report.unplaceable[0]


def test_replicas_beyond_the_free_slices_are_pending_not_refused():
    # 3 x 1g slices in all (2 + 1); 4 replicas ask for 4: the fourth waits.
    report = check_placement(pool_demands(config(on_slice("small", "mig-1g.18gb", replicas=4))),
                             [SMALL_SLICES, BIG_SLICE])
    assert report.ok
    assert report.assignment[("small", "colocated")] == ["bbbbbbbb00", "bbbbbbbb00", "cccccccc00"]
    assert report.pending == ["model 'small': 1 of 4 replicas do not fit beside the others at once and wait for "
                              "resources ({CPU: 0.1, mig-1g.18gb: 1} each)"]


def test_disaggregated_pools_are_checked_apart():
    model = {**model_entry("pd"), "resources": {"num_cpus": 0.1}, "disaggregation": {
        "prefill": {"replicas": 1, "custom_resources": {"mig-3g.71gb": 1}},
        "decode": {"replicas": 1, "custom_resources": {"mig-7g.141gb": 1}}}}
    report = check_placement(pool_demands(config(model)), [SMALL_SLICES, BIG_SLICE])
    assert report.assignment[("pd", "prefill")] == ["cccccccc00"]
    assert [line.split(":")[0] for line in report.unplaceable] == ["model 'pd' (decode pool)"]


def test_no_alive_node_refuses_every_pool():
    report = check_placement(pool_demands(config(on_slice("a", "mig-1g.18gb"))), [])
    assert report.unplaceable[0].endswith("Nodes: none alive")


def test_cpu_engines_pinned_by_this_machine_are_named_on_a_cluster_of_several_nodes():
    pinned = {**model_entry("pinned"), "resources": {"num_cpus": 0.1, "cpu_binding": ["0-3"]}}
    on_gpu = {**model_entry("gpu"), "resources": {"num_cpus": 0.1, "num_gpus": 1}}
    pd = {**model_entry("pd"), "resources": {"num_cpus": 0.1}, "disaggregation": {
        "prefill": {"cpu_binding": ["4-5"]}, "decode": {}}}
    platform = config(on_slice("small", "mig-1g.18gb"), pinned, on_gpu, pd)
    # Only the pools whose cores the platform plans: small, and pd's decode pool.
    assert unpinned_cpu_warning(platform, num_nodes=3, num_local_cores=8) == (
        "small, pd (decode): CPU engines without resources.cpu_binding are pinned as if all ran on this machine's 8 "
        "cores, not on the cores of the 3 nodes they run on; set cpu_binding per model (or per pool) for this cluster")
    # On one node (a cluster this machine started, or joined alone) the plan holds.
    assert unpinned_cpu_warning(platform, num_nodes=1, num_local_cores=8) is None
    assert unpinned_cpu_warning(config(pinned, on_gpu), num_nodes=3, num_local_cores=8) is None
