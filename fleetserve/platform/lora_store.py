"""Resolves a LoRA adapter source to a local PEFT folder that vLLM can load.

Sources:
  * a local PEFT folder (has ``adapter_config.json``): used in place;
  * a PEFT folder in object storage (``s3://``, ``gs://``, ``az://``): fetched once per version
    (``object_store.py``), then checked as a local one;
  * ``random-lora:<seed>``: a random adapter for the base model, built once with PEFT and cached. Its
    weights are non-zero, so it changes the base model's output: tests and demos use it where no trained
    adapter exists (no model hub here).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fleetserve.platform.model_store import atomic_folder, cache_root
from fleetserve.platform.object_store import ObjectStoreError, is_object_store_uri, snapshot

RANDOM_LORA_PREFIX = "random-lora:"
# Rank of built random adapters; a model's lora.max_lora_rank must be at least this.
RANDOM_LORA_RANK = 8
# Bump when the random adapter's recipe changes, so cached copies are rebuilt.
_RANDOM_LORA_VERSION = 1
# Layers a random adapter targets: every projection of a Llama-style block.
_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Files vLLM's LoRA loader reads an adapter's weights from (vllm/lora/lora_model.py), any one of them.
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
# What an adapter folder in object storage is fetched with: its config, weights and any tokenizer files.
ADAPTER_FILE_PATTERNS = ("*.json", *ADAPTER_WEIGHT_FILES, "*.model", "*.txt", "*.jinja", "tokenizer*")


class AdapterSourceError(ValueError):
    """An adapter source that cannot be resolved; the message says what was expected.

    Args:
        status_code: the HTTP status an API answers with: 400 for a malformed source, 404 for one not found.
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code

    def __reduce__(self):  # survives pickling with its status
        return (AdapterSourceError, (str(self), self.status_code))


def check_adapter_source(source: str, max_lora_rank: int | None = None) -> None:
    """Checks that ``source`` names a PEFT folder here, or is ``random-lora:<seed>``, without building it.

    Args:
        source: the adapter's source, as configured or sent to the admin API.
        max_lora_rank: the base model's ``lora.max_lora_rank``; given, a folder is also checked as
            ``check_adapter_folder`` does.

    Raises:
        AdapterSourceError: neither a PEFT folder nor ``random-lora:<seed>``, or a folder vLLM would refuse.
    """
    if source.startswith(RANDOM_LORA_PREFIX):
        if not source.removeprefix(RANDOM_LORA_PREFIX).isdigit():
            raise AdapterSourceError(f"adapter source {source!r}: expected {RANDOM_LORA_PREFIX}<seed>, "
                                     f"a non-negative integer seed", 400)
    elif is_object_store_uri(source):
        return  # read where it is fetched, with the credentials of the replicas that load it
    elif not (Path(source).expanduser() / "adapter_config.json").exists():
        raise AdapterSourceError(f"adapter source {source!r} not found: expected a PEFT adapter folder "
                                 f"(with adapter_config.json) here or in object storage (s3://, gs://, az://), "
                                 f"or {RANDOM_LORA_PREFIX}<seed>", 404)
    elif max_lora_rank is not None:
        check_adapter_folder(Path(source).expanduser(), max_lora_rank)


def check_adapter_folder(path: Path, max_lora_rank: int) -> None:
    """Refuses a PEFT folder that vLLM's LoRA loader would refuse, read by vLLM's own PEFT reader: no weights,
    a rank above ``max_lora_rank``, or a PEFT feature vLLM does not implement (DoRA, LoRA bias, ...).

    vLLM finds these only when an engine loads the adapter, and answers a 500; a configured adapter it refuses
    stops the replica's whole OpenAI app from building.

    Raises:
        AdapterSourceError: (400) with vLLM's reason.
    """
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    if not any((path / name).is_file() for name in ADAPTER_WEIGHT_FILES):
        raise AdapterSourceError(f"adapter folder {path} holds no weights: expected one of "
                                 f"{', '.join(ADAPTER_WEIGHT_FILES)}", 400)
    try:
        PEFTHelper.from_local_dir(str(path), None).validate_legal(LoRAConfig(max_lora_rank=max_lora_rank))
    except (ValueError, TypeError) as error:  # a malformed adapter_config.json is a JSONDecodeError (ValueError)
        raise AdapterSourceError(f"adapter folder {path}: {error}", 400) from None


def resolve_adapter_source(source: str, base_path: Path, max_lora_rank: int) -> Path:
    """A local PEFT folder for ``source`` that vLLM will load, building a random adapter for ``base_path`` if
    asked.

    Raises:
        AdapterSourceError: neither a PEFT folder nor ``random-lora:<seed>``, or a folder vLLM would refuse.
    """
    check_adapter_source(source)
    if source.startswith(RANDOM_LORA_PREFIX):
        path = random_lora(base_path, int(source.removeprefix(RANDOM_LORA_PREFIX)))
    elif is_object_store_uri(source):
        try:
            path = snapshot(source, ADAPTER_FILE_PATTERNS, "adapter_config.json", cache_root())
        except ObjectStoreError as error:
            raise AdapterSourceError(f"adapter source {error}", 404 if error.missing else 400) from None
    else:
        path = Path(source).expanduser()
    check_adapter_folder(path, max_lora_rank)
    return path


def random_lora(base_path: Path, seed: int) -> Path:
    """The cached random adapter (rank ``RANDOM_LORA_RANK``) for the base model folder, built on first use."""
    key = hashlib.sha256(f"{base_path.resolve()}:{seed}:{_RANDOM_LORA_VERSION}".encode()).hexdigest()[:16]
    final = cache_root() / "adapters" / f"random-lora-{seed}-{key}"
    if (final / "adapter_config.json").exists():
        return final
    with atomic_folder(final, marker="adapter_config.json") as scratch:
        build_random_lora(base_path, scratch, seed)
    return final


def build_random_lora(base_path: Path, out: Path, seed: int, rank: int = RANDOM_LORA_RANK) -> None:
    """Writes a PEFT LoRA adapter with random (non-zero) A and B matrices for the base model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, torch_dtype=torch.float32)
    present = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    targets = [name for name in _TARGET_MODULES if name in present]
    torch.manual_seed(seed)
    # init_lora_weights=False draws B at random too (PEFT's default zeroes it: an adapter that changes nothing).
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)
