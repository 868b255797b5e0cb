"""A base model's LoRA adapters: each served as its own model name, with vLLM's LoRA limits."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from fleetserve.platform.config.base import ModelName, Strict


# The ranks vLLM sizes adapter buffers for (vllm.config.lora.MaxLoRARanks; a test keeps the two equal), so a
# config is refused here rather than by the engine once a replica starts.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraAdapter(Strict):
    """One adapter, served as the model name ``name``."""

    # The name clients send as ``model``; it lists in /v1/models with the base model as its parent.
    name: ModelName
    # A local PEFT adapter folder, or ``random-lora:<seed>`` (a random adapter for the base, built locally).
    source: str



class LoraConfig(Strict):
    """LoRA serving for one base model (vLLM's --enable-lora and its limits)."""

    # Adapters every replica serves from its start; more can be loaded at run time (admin API).
    adapters: list[LoraAdapter] = Field(default_factory=list)
    # A folder (local to the replicas, or s3://, gs://, az://) whose subfolders are adapters loaded on their first
    # request, named `<model>:<subfolder>` as Ray Serve LLM names them; None: only adapters configured or loaded
    # through the admin API.
    adapter_root: str | None = None
    # Adapters one engine step can run at once (vLLM's max_loras): its GPU-resident adapter slots.
    max_loras: int = Field(default=1, ge=1)
    # Largest adapter rank the engine accepts (vLLM's max_lora_rank); it sizes the adapter buffers.
    max_lora_rank: int = 16
    # Adapters an engine keeps in host memory (vLLM's max_cpu_loras); None: vLLM's default (max_loras).
    max_cpu_loras: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank {self.max_lora_rank} is not one vLLM takes: one of "
                             f"{', '.join(map(str, MAX_LORA_RANKS))} (the smallest at least your adapters' rank)")
        names = [adapter.name for adapter in self.adapters]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"adapters {twice} appear twice; adapter names must be unique")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM engine arguments for these limits."""
        kwargs: dict[str, Any] = {"enable_lora": True, "max_loras": self.max_loras,
                                  "max_lora_rank": self.max_lora_rank}
        if self.max_cpu_loras is not None:
            kwargs["max_cpu_loras"] = self.max_cpu_loras
        return kwargs
