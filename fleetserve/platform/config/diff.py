"""What applying a platform config changes against the running one (``fleetserve apply``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetserve.platform.config.platform import PlatformConfig

# A model's keys changed in place: replica counts and autoscaling by Serve, LoRA adapters by the registry
# its replicas converge on. Any other key restarts its replicas.
IN_PLACE_KEYS = frozenset({"replicas", "autoscaling", "lora.adapters"})
# Platform sections besides the models.
SECTIONS = ("server", "model_routing", "auth", "limits", "batches")


@dataclass(frozen=True)
class ConfigChange:
    """The difference between the running config and the one applied."""

    # Models only the applied config has: started.
    added: list[str] = field(default_factory=list)
    # Models only the running config has: stopped.
    removed: list[str] = field(default_factory=list)
    # Model -> its top-level keys whose values differ (`lora.adapters` when only its adapters do).
    changed: dict[str, list[str]] = field(default_factory=dict)
    # Platform sections whose values differ.
    sections: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.sections)

    def restarts(self, model: str) -> bool:
        """Whether the change restarts the model's replicas (any key beyond the in-place ones)."""
        return bool(set(self.changed.get(model, ())) - IN_PLACE_KEYS)

    def describe(self) -> list[str]:
        """One line per change, for the CLI."""
        lines = [f"+ {name}: start" for name in self.added] + [f"- {name}: stop" for name in self.removed]
        for name, keys in self.changed.items():
            how = "restart its replicas" if self.restarts(name) else "in place"
            lines.append(f"~ {name}: {', '.join(keys)} ({how})")
        lines += [f"~ {section}" for section in self.sections]
        return lines


def diff_configs(running: PlatformConfig, applied: PlatformConfig) -> ConfigChange:
    """The models added, removed and changed (with which keys), and the platform sections changed."""
    before = {model.name: model.model_dump(mode="json") for model in running.models}
    after = {model.name: model.model_dump(mode="json") for model in applied.models}
    changed = {name: sorted(_changed_keys(before[name], after[name]))
               for name in after if name in before and after[name] != before[name]}
    sections = [section for section in SECTIONS
                if getattr(running, section) != getattr(applied, section)]
    return ConfigChange(added=[name for name in after if name not in before],
                        removed=[name for name in before if name not in after], changed=changed, sections=sections)


def _changed_keys(before: dict, after: dict) -> list[str]:
    """A model's top-level keys that differ; ``lora.adapters`` when the LoRA section differs in its adapters
    alone."""
    keys = [key for key in after if after[key] != before.get(key)]
    lora_before, lora_after = before.get("lora"), after.get("lora")
    if "lora" in keys and lora_before is not None and lora_after is not None:
        if {**lora_before, "adapters": None} == {**lora_after, "adapters": None}:
            keys[keys.index("lora")] = "lora.adapters"
    return keys
