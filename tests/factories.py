"""Small data factories shared by tests and fixtures (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fleetserve.router.model.routing_data import CorrectnessTable


def synthetic_correctness(num_prompts: int = 40, hard_every: int = 4) -> CorrectnessTable:
    """Prompt i is hard when i % hard_every == 0: only the strong model answers it; both answer the rest."""
    hard = [i % hard_every == 0 for i in range(num_prompts)]
    prompts = [f"{'prove this difficult theorem rigorously' if h else 'say hello politely'} case {i}"
               for i, h in enumerate(hard)]
    correct = np.array([[not h, True] for h in hard])
    return CorrectnessTable(prompts, ["weak-model", "strong-model"], correct)


# A hard and an easy prompt in synthetic_correctness()'s words.
HARD_PROMPT = "prove this difficult theorem rigorously case 0"
EASY_PROMPT = "say hello politely case 1"


def calibrated_classifier(strong_fraction: float = 0.25) -> Any:
    """A hashing-256 classifier trained on synthetic_correctness() and calibrated on its prompts."""
    from fleetserve.router.model.embedders import make_embedder
    from fleetserve.router.model.quality_router import train_router

    data = synthetic_correctness()
    router = train_router("classifier", data, make_embedder("hashing-256"))
    router.calibrate(data.prompts, strong_fraction)
    return router


MiB = 1024 * 1024


def peft_folder(path: Path, r: int = 8, weights: bool = True, **fields: Any) -> Path:
    """A PEFT adapter folder as vLLM's checks read it: ``adapter_config.json``, and an (empty) weights file."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"], **fields}
    (path / "adapter_config.json").write_text(json.dumps(config))
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"")
    return path


# Tests run vLLM eagerly: torch.compile adds ~12 s to every engine start on these CPUs and the suite
# starts dozens of engines; production configs keep vLLM's default.
TEST_EXTRA_ARGS = {"enforce_eager": True}


def model_entry(name: str = "tiny", source: str = "tiny-random-llama", **engine_args: Any) -> dict[str, Any]:
    """A model config entry with tiny defaults: float32 (reproducible greedy output), short context, eager."""
    args = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 64 * MiB, "max_num_seqs": 32}
    extra = {**TEST_EXTRA_ARGS, **engine_args.pop("extra", {})}
    args.update(engine_args, extra=extra)
    return {"name": name, "source": source, "engine_args": args}


class RecordingHandle:
    """A Serve handle stand-in that records the options each ``.options()`` call asks for."""

    def __init__(self, app_name: str = "fleetserve", deployment_name: str = "engine-tiny") -> None:
        self.app_name, self.deployment_name = app_name, deployment_name
        self.option_calls: list[dict[str, Any]] = []

    def options(self, **kwargs: Any) -> RecordingHandle:
        self.option_calls.append(kwargs)
        return self
