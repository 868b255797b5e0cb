"""The LoRA adapter registry: versions of each base model's set, and which replicas serve them."""

from fleetserve.platform.adapter_registry import AdapterOp, AdapterRegistry, AdapterSet


def registry() -> AdapterRegistry:
    return AdapterRegistry({"base": {"a": "random-lora:1"}})


def test_configured_set_is_version_zero():
    assert registry().desired("base") == AdapterSet(0, {"a": "random-lora:1"})
    assert registry().desired("other") == AdapterSet(0, {})
    assert registry().bases() == {"a": "base"}


def test_each_change_bumps_the_version():
    adapters = registry()
    assert adapters.apply(AdapterOp.LOAD, "base", "b", "/adapters/b") == AdapterSet(
        1, {"a": "random-lora:1", "b": "/adapters/b"})
    assert adapters.apply(AdapterOp.UNLOAD, "base", "a") == AdapterSet(2, {"b": "/adapters/b"})
    assert adapters.bases() == {"b": "base"}


def test_progress_counts_live_replicas_at_the_version():
    adapters = registry()
    version = adapters.apply(AdapterOp.LOAD, "base", "b", "/adapters/b").version
    adapters.record_applied("r0", "base", version)
    adapters.record_applied("r1", "base", 0)
    adapters.record_applied("x0", "other", 7)
    # r0 serves version 1; r1 is behind; r2 has not reported; x0 is another base's replica.
    assert adapters.progress("base", version, ["r0", "r1", "r2"]) == (1, 3)
    adapters.forget(["r0"])
    assert adapters.progress("base", version, ["r1"]) == (0, 1)


def test_a_new_config_changes_its_own_adapters_and_keeps_those_loaded_at_run_time():
    adapters = AdapterRegistry({"base": {"a": "random-lora:1", "b": "random-lora:2"}})
    adapters.apply(AdapterOp.LOAD, "base", "run", "/adapters/run")  # version 1, through the admin API
    # The config drops b, gives a a new source and adds c: one change, version 2; `run` stays.
    assert adapters.reconcile({"base": {"a": "random-lora:7", "c": "random-lora:3"}}) == {"base": 2}
    assert adapters.desired("base") == AdapterSet(2, {"a": "random-lora:7", "c": "random-lora:3",
                                                      "run": "/adapters/run"})
    assert adapters.reconcile({"base": {"a": "random-lora:7", "c": "random-lora:3"}}) == {}  # the same config


def test_a_new_config_leaves_an_adapter_the_admin_unloaded_or_reloaded():
    adapters = registry()
    adapters.apply(AdapterOp.UNLOAD, "base", "a")
    adapters.apply(AdapterOp.LOAD, "base", "b", "/adapters/b")
    adapters.apply(AdapterOp.LOAD, "base", "b", "/adapters/b2")  # reloaded in place: version 3
    # a is still configured with its source: the config did not change it, so the admin's unload holds.
    assert adapters.reconcile({"base": {"a": "random-lora:1"}, "second": {"s": "random-lora:5"}}) == {"second": 0}
    assert adapters.desired("base") == AdapterSet(3, {"b": "/adapters/b2"})
    # A base model new to the config starts at version 0, the set its replicas load as they start.
    assert adapters.desired("second") == AdapterSet(0, {"s": "random-lora:5"})


def test_a_base_the_config_no_longer_gives_adapters_loses_its_set():
    adapters = registry()
    adapters.apply(AdapterOp.LOAD, "base", "run", "/adapters/run")
    assert adapters.reconcile({}) == {}
    assert adapters.bases() == {} and adapters.desired("base") == AdapterSet(0, {})
