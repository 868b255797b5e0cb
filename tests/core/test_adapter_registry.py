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
