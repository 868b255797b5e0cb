"""Capacity planner: which GPU slice each model needs, and how the slices pack onto MIG layouts.

The memory math, per model:

* weight bytes: parameters (from the safetensors headers when present, else from the config's shape)
  times the bytes per parameter of the served dtype or quantization;
* KV bytes per token: ``2 (K and V) x layers x kv_heads x head_dim x KV dtype bytes``;
* LoRA buffers (models with ``lora:``): vLLM allocates an A and a B matrix of ``max_lora_rank`` for each of
  ``max_loras`` adapter slots in every projection, the embedding and the LM head, in the activation dtype;
* need: weights + LoRA buffers + target concurrency x context length x KV bytes per token, which must fit in
  the slice's usable memory (``memory x memory_utilization - activation_reserve``, as vLLM reserves it);
* decode ceiling: every decode step reads the weights once and each sequence's KV, so at batch B and
  context C, tokens/s <= B x bandwidth / (weights + B x C x KV bytes per token);
* cold start: weight bytes / load bandwidth + engine start-up;
* cost per 1M output tokens: $/GPU-hour x the slice's share of the GPU / (decode ceiling x 3600) x 1e6;
* what a replica does there, as the autoscaling simulator's replica profile: KV tokens its pool holds, prefill
  tokens/s (2 FLOPs per parameter per token at ``compute_efficiency`` of the slice's peak), and a decode step's
  time (the weights read once, each sequence's compute, each sequence's KV read).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from fleetserve.platform.config import RAY_MIG_RESOURCE_PREFIX, ModelConfig, PlatformConfig
from fleetserve.ops.gpus import GpuSpec, MigProfile

GiB = 1024**3
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1, "int8": 1}
# Bytes per parameter for quantization methods vLLM serves (4-bit weights; scales add ~3%).
_QUANT_BYTES = {"awq": 0.53, "gptq": 0.53, "bitsandbytes": 0.53, "gguf": 0.6, "fp8": 1.0, "int8": 1.0}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
                      "I32": 4, "I64": 8}


# Tensor-parallel sizes the planner tries, fewest GPUs first: up to one 8-GPU node's NVLink domain.
TENSOR_PARALLEL_SIZES = (2, 4, 8)
# Parts of a GPU a replica may take when replicas share GPUs without MIG, smallest first: halvings, so that
# Ray's packing of fractional GPUs leaves no unusable gaps.
SHARED_PARTS = (8, 4, 2)


class Partitioning(str, Enum):
    """How replicas take GPUs."""

    # Each replica takes whole GPUs (several, over tensor-parallel ranks, when one does not hold it).
    WHOLE = "whole"
    # Each replica takes one MIG slice (hardware-isolated memory and compute).
    MIG = "mig"
    # Small replicas take 1/8, 1/4 or 1/2 of a GPU without MIG (resources.num_gpus below 1; Ray packs them onto
    # one GPU, each engine held to its part of the memory); larger ones take whole GPUs.
    SHARED = "shared"


class PlanError(ValueError):
    """A model that cannot be placed; the message says by how much it misses."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of one model."""

    name: str
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Bytes per parameter as served (dtype or quantization).
    bytes_per_param: float
    # Bytes per KV element (the KV cache dtype).
    kv_dtype_bytes: int
    # Attention heads: a tensor-parallel size must divide them.
    num_heads: int = 1
    # Widths the LoRA buffers are sized by: the residual stream, the MLP, the vocabulary.
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    # Bytes per activation element (the dtype vLLM's LoRA buffers take, lora_dtype auto).
    activation_dtype_bytes: int = 2
    # A speculative decoding draft served in the same engine: its weights load beside the model's, and its
    # layers take KV from the same pool, for every token the model holds.
    draft: ModelShape | None = None

    @property
    def weight_bytes(self) -> int:
        own = int(round(self.num_params * self.bytes_per_param))
        return own + (self.draft.weight_bytes if self.draft is not None else 0)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_rank(1)

    def kv_bytes_per_token_per_rank(self, num_ranks: int) -> int:
        """One rank's KV per token over ``num_ranks`` ranks: its share of the KV heads, and a whole head when
        there are more ranks than KV heads (vLLM then copies each KV head to several ranks); a draft's too."""
        heads = max(1, self.num_kv_heads // num_ranks)
        own = 2 * self.num_layers * heads * self.head_dim * self.kv_dtype_bytes
        return own + (self.draft.kv_bytes_per_token_per_rank(num_ranks) if self.draft is not None else 0)

    def lora_bytes_per_rank(self, lora: LoraSlots | None, num_ranks: int = 1) -> int:
        """One rank's LoRA buffers, as vLLM allocates them at start (vllm/lora/layers): per adapter slot, A
        (rank x in) and B (out x rank) for q, k, v, o, gate, up and down in every layer, and for the embedding
        and the LM head.

        Over several ranks, column-parallel projections (q, k, v, gate, up) split B's rows, row-parallel ones
        (o, down) A's columns, and the embedding's and LM head's stay whole. With ``fully_sharded`` the ranks
        also split column-parallel A's rank and row-parallel B's rows.
        """
        if lora is None:
            return 0
        hidden, inner = self.hidden_size, self.intermediate_size
        q_width = self.num_heads * self.head_dim
        kv_width = max(1, self.num_kv_heads // num_ranks) * self.head_dim * num_ranks
        column = [(hidden, q_width), (hidden, kv_width), (hidden, kv_width), (hidden, inner), (hidden, inner)]
        row = [(q_width, hidden), (inner, hidden)]
        # In units of one rank's column: A is rank x in, B is out x rank.
        shared = num_ranks if lora.fully_sharded else 1
        per_layer = (sum(width_in // shared + width_out // num_ranks for width_in, width_out in column)
                     + sum(width_in // num_ranks + width_out // shared for width_in, width_out in row))
        embedding_and_head = 2 * (self.vocab_size + hidden)
        elements = (self.num_layers * per_layer + embedding_and_head) * lora.max_lora_rank * lora.max_loras
        return elements * self.activation_dtype_bytes


@dataclass(frozen=True)
class LoraSlots:
    """A model's LoRA limits, as its engine allocates buffers for them."""

    # Adapters one step runs at once: the slots vLLM allocates buffers for.
    max_loras: int
    # The rank every slot's buffers are sized for.
    max_lora_rank: int
    # vLLM's fully_sharded_loras: tensor-parallel ranks also split the parts of A and B they keep whole by default.
    fully_sharded: bool = False


def params_from_config(config: dict[str, Any]) -> int:
    """Parameter count of a Llama-family decoder (Llama, Mistral, Qwen2, Gemma) from its config.json.

    Embedding, then per layer q/k/v/o projections (with q/k/v biases when ``attention_bias`` or
    Qwen2), the gated MLP's three matrices and two norms, then the final norm and an untied LM head.
    """
    hidden = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    kv_width = config.get("num_key_value_heads", num_heads) * head_dim
    q_width = num_heads * head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        attention += q_width + 2 * kv_width
    mlp = 3 * hidden * config["intermediate_size"]
    per_layer = attention + mlp + 2 * hidden
    embedding = config["vocab_size"] * hidden
    head = 0 if config.get("tie_word_embeddings", False) else embedding
    return embedding + config["num_hidden_layers"] * per_layer + hidden + head


def _safetensors_params(folder: Path) -> int | None:
    """Parameters counted from the safetensors headers (8-byte length, then JSON); None without them."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def _dtype_bytes(config: dict[str, Any], dtype: str) -> int:
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dtype!r}; the planner knows {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def _bytes_per_param(config: dict[str, Any], dtype: str, quantization: str | None) -> float:
    quant = quantization or (config.get("quantization_config") or {}).get("quant_method")
    if not quant:
        return _dtype_bytes(config, dtype)
    if quant not in _QUANT_BYTES:
        raise PlanError(f"unknown quantization {quant!r}; the planner knows {sorted(_QUANT_BYTES)}")
    return _QUANT_BYTES[quant]


def model_shape(name: str, folder: Path, dtype: str = "auto", quantization: str | None = None,
                kv_cache_dtype: str = "auto") -> ModelShape:
    """Reads a HF model folder's config.json (and safetensors headers when present).

    Args:
        dtype: the served dtype ("auto": the config's torch_dtype).
        quantization: overrides the config's quantization_config.quant_method.
        kv_cache_dtype: "auto" stores KV in the activation dtype (bf16/fp16 for quantized weights).

    Raises:
        PlanError: no config.json, or an architecture the planner cannot count.
    """
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PlanError(f"{name}: cannot read {folder / 'config.json'}: {error}") from None
    config = config.get("text_config", config)  # multimodal wrappers (Gemma 3) keep the decoder here
    try:
        num_heads = config["num_attention_heads"]
        return ModelShape(
            name=name, num_params=_safetensors_params(folder) or params_from_config(config),
            num_layers=config["num_hidden_layers"], num_kv_heads=config.get("num_key_value_heads", num_heads),
            num_heads=num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            bytes_per_param=_bytes_per_param(config, dtype, quantization),
            kv_dtype_bytes=_dtype_bytes(config, dtype if kv_cache_dtype == "auto" else kv_cache_dtype),
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"], activation_dtype_bytes=_dtype_bytes(config, dtype))
    except KeyError as error:
        raise PlanError(f"{name}: config.json lacks {error}; the planner handles Llama-family decoders") from None


@dataclass(frozen=True)
class PlanInputs:
    """The serving targets and assumptions a plan is made for."""

    # Tokens per sequence (prompt + output) to hold in KV.
    context_len: int = 4096
    # Sequences each replica must hold at that context.
    concurrency: int = 8
    # Dollars per whole-GPU hour.
    price_per_gpu_hour: float = 4.0
    # Share of slice memory vLLM may use (gpu_memory_utilization).
    memory_utilization: float = 0.9
    # Activations, CUDA graphs and the allocator's slack, per replica.
    activation_reserve_bytes: int = 1 * GiB
    # Weight loading speed at start-up (local NVMe or a warm page cache).
    load_bandwidth_bytes_per_s: float = 2e9
    # Engine start beyond loading weights (CUDA init, profiling, graph capture).
    startup_overhead_s: float = 30.0
    # Share of the slice's peak tensor FLOP/s that prefill and decode compute sustain (model FLOPs utilization).
    compute_efficiency: float = 0.3


@dataclass(frozen=True)
class Slice:
    """Where a replica can run: a MIG profile, or the whole GPU (profile None)."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    # Share of the GPU the slice blocks, for cost: max of its compute and memory shares.
    gpu_share: float
    profile: MigProfile | None = None
    # Peak dense 16-bit tensor FLOP/s: the GPU's, times the slice's compute share.
    flops_per_s: float = 0.0
    # The part of one GPU a replica here asks Ray for (resources.num_gpus): below 1 for a shared GPU's part.
    gpu_fraction: float = 1.0

    def usable_bytes(self, inputs: PlanInputs) -> float:
        return self.memory_bytes * inputs.memory_utilization - inputs.activation_reserve_bytes


def slices(gpu: GpuSpec, partitioning: Partitioning) -> list[Slice]:
    """Candidate slices from smallest to largest: MIG profiles, parts of a shared GPU, or the whole GPU.

    A part of a shared GPU is planned with that part of its memory, bandwidth and compute: what it gets while
    every replica on the GPU is busy (an idle neighbour leaves it more bandwidth and compute, never memory).

    Raises:
        PlanError: MIG on a GPU that has none.
    """
    whole = Slice("gpu", gpu.memory_bytes, gpu.memory_bandwidth_bytes_per_s, 1.0, flops_per_s=gpu.peak_flops)
    if partitioning is Partitioning.WHOLE:
        return [whole]
    if partitioning is Partitioning.SHARED:
        return [Slice(f"gpu/{parts}", gpu.memory_bytes // parts, gpu.memory_bandwidth_bytes_per_s / parts, 1 / parts,
                      flops_per_s=gpu.peak_flops / parts, gpu_fraction=1 / parts) for parts in SHARED_PARTS] + [whole]
    if not gpu.profiles:
        raise PlanError(f"{gpu.name} has no MIG; plan it with --shared (parts of a GPU) or whole GPUs")
    ordered = sorted(gpu.profiles, key=lambda p: (p.memory_bytes, p.num_compute_slices))
    return [Slice(p.name, p.memory_bytes, gpu.memory_bandwidth_bytes_per_s * p.memory_share,
                  max(p.compute_share, p.memory_share), p, gpu.peak_flops * p.compute_share) for p in ordered]


@dataclass(frozen=True)
class ModelPlan:
    """One model's placement and what it can do there."""

    model: str
    replicas: int
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    # Weights + LoRA buffers + KV for the target concurrency at the context length.
    need_bytes: int
    # The smallest slice that fits ("gpu" for a whole GPU).
    slice: str
    slice_usable_bytes: int
    # Sequences at the context length the slice's KV room holds.
    max_concurrent_seqs: int
    # Decode tokens/s ceilings from memory bandwidth: one stream, and the target concurrency.
    single_stream_tokens_per_s: float
    decode_tokens_per_s: float
    cold_start_s: float
    cost_per_million_output_tokens: float
    # GPUs one replica shards the model over (whole GPUs only); slice_usable_bytes is per GPU.
    tensor_parallel_size: int = 1
    # LoRA buffers each GPU allocates for the model's adapter slots (0 without lora:).
    lora_bytes_per_gpu: int = 0
    # What one replica does there (derived, not measured), the autoscaling simulator's replica profile: KV
    # tokens the slice's KV pool holds; prompt tokens prefilled per second; a decode step's time, which is
    # decode_step_base_s (the weights read once) + decode_step_per_seq_s per sequence (its compute)
    # + decode_step_per_kv_token_s per KV token the batch holds (each sequence's KV read).
    kv_capacity_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_step_base_s: float = 0.0
    decode_step_per_seq_s: float = 0.0
    decode_step_per_kv_token_s: float = 0.0
    # The part of a GPU a replica asks Ray for: below 1 on a shared GPU (slice "gpu/4": 0.25).
    gpu_fraction: float = 1.0

    @property
    def kv_cache_bytes_per_gpu(self) -> int:
        """What each GPU keeps for KV once its share of the weights and its LoRA buffers are allocated (vLLM's
        kv_cache_memory_bytes)."""
        return self.slice_usable_bytes - self.weight_bytes // self.tensor_parallel_size - self.lora_bytes_per_gpu


def _per_rank_need(shape: ModelShape, inputs: PlanInputs, num_ranks: int, lora: LoraSlots | None) -> float:
    """One rank's bytes: its share of the weights, of the LoRA buffers and of the target KV."""
    return (shape.weight_bytes / num_ranks + shape.lora_bytes_per_rank(lora, num_ranks)
            + inputs.concurrency * inputs.context_len * shape.kv_bytes_per_token_per_rank(num_ranks))


def _tensor_parallel_size(shape: ModelShape, whole_gpu: Slice, inputs: PlanInputs, at_least: int,
                          lora: LoraSlots | None) -> int | None:
    """The fewest GPUs of one node, ``at_least`` of them, a model shards over to fit (they must divide its
    attention heads)."""
    sizes = [at_least] + [ranks for ranks in TENSOR_PARALLEL_SIZES if ranks > at_least]
    return next((ranks for ranks in sizes if ranks > 1 and shape.num_heads % ranks == 0
                 and _per_rank_need(shape, inputs, ranks, lora) <= whole_gpu.usable_bytes(inputs)), None)


def plan_model(shape: ModelShape, gpu: GpuSpec, partitioning: Partitioning, inputs: PlanInputs, replicas: int = 1,
               min_tensor_parallel_size: int = 1, lora: LoraSlots | None = None) -> ModelPlan:
    """Places one model on the smallest slice that holds its weights, LoRA buffers and target KV; without MIG,
    a model no GPU holds is sharded over the fewest GPUs of one node that do (tensor parallelism).

    Args:
        partitioning: whole GPUs, MIG slices, or parts of shared GPUs.
        min_tensor_parallel_size: the model's configured tensor-parallel size, which the plan keeps (or raises,
            where the model does not fit that way).
        lora: the model's LoRA adapter slots, whose buffers take memory beside the weights; None without lora:.

    Raises:
        PlanError: when nothing fits, saying by how much the largest slice (or a whole node) misses; or a
            configured tensor-parallel size on MIG slices.
    """
    kv_needed = inputs.concurrency * inputs.context_len * shape.kv_bytes_per_token
    lora_bytes = shape.lora_bytes_per_rank(lora)
    need = shape.weight_bytes + lora_bytes + kv_needed
    mig = partitioning is Partitioning.MIG
    candidates = slices(gpu, partitioning)
    if mig and min_tensor_parallel_size > 1:
        raise PlanError(f"{shape.name} sets tensor_parallel_size {min_tensor_parallel_size}, which needs whole GPUs "
                        f"(no tensor parallelism across MIG instances); plan it without --mig")
    chosen = (next((s for s in candidates if s.usable_bytes(inputs) >= need), None)
              if min_tensor_parallel_size == 1 else None)
    num_ranks = 1
    if chosen is None and not mig:
        num_ranks = _tensor_parallel_size(shape, candidates[-1], inputs, min_tensor_parallel_size, lora) or 0
        chosen = candidates[-1] if num_ranks else None
    if chosen is None:
        largest = candidates[-1]
        usable = largest.usable_bytes(inputs)
        where = f"the largest {gpu.name} MIG slice ({largest.name})" if mig else f"a whole {gpu.name}"
        hint = (" MIG slices cannot be combined (no tensor parallelism across MIG instances); plan it without --mig"
                if mig else f" Nor does it fit sharded over up to {TENSOR_PARALLEL_SIZES[-1]} GPUs of one node "
                            f"(tensor parallel sizes dividing its {shape.num_heads} attention heads).")
        adapters = f"{lora_bytes / GiB:.1f} GiB LoRA buffers + " if lora_bytes else ""
        raise PlanError(
            f"{shape.name} needs {need / GiB:.1f} GiB ({shape.weight_bytes / GiB:.1f} GiB weights + {adapters}"
            f"{kv_needed / GiB:.1f} GiB KV for {inputs.concurrency} x {inputs.context_len} tokens); {where} "
            f"offers {usable / GiB:.1f} GiB usable: short by {(need - usable) / GiB:.1f} GiB.{hint}")
    usable = chosen.usable_bytes(inputs)
    rank_weights = shape.weight_bytes / num_ranks
    rank_lora = shape.lora_bytes_per_rank(lora, num_ranks)
    rank_kv_per_token = shape.kv_bytes_per_token_per_rank(num_ranks)
    rank_kv_per_seq = inputs.context_len * rank_kv_per_token
    max_seqs = int((usable - rank_weights - rank_lora) // rank_kv_per_seq)
    batch = inputs.concurrency
    # Ranks read their shards side by side: a step takes one rank's bytes over one GPU's bandwidth (the
    # all-reduces between ranks are left out: these are ceilings).
    step_bytes = rank_weights + batch * rank_kv_per_seq
    decode = batch * chosen.bandwidth_bytes_per_s / step_bytes
    single = chosen.bandwidth_bytes_per_s / rank_weights
    cost = inputs.price_per_gpu_hour * chosen.gpu_share * num_ranks / (decode * 3600) * 1e6
    cold = shape.weight_bytes / inputs.load_bandwidth_bytes_per_s + inputs.startup_overhead_s
    # Every rank computes its share of each token's 2 FLOPs per parameter, side by side.
    rank_flops = 2 * shape.num_params / num_ranks
    sustained_flops = chosen.flops_per_s * inputs.compute_efficiency
    return ModelPlan(shape.name, replicas, shape.num_params, shape.weight_bytes, shape.kv_bytes_per_token, need,
                     chosen.name, int(usable), max_seqs, single, decode, cold, cost, num_ranks, rank_lora,
                     kv_capacity_tokens=int((usable - rank_weights - rank_lora) // rank_kv_per_token),
                     prefill_tokens_per_s=sustained_flops / rank_flops,
                     decode_step_base_s=rank_weights / chosen.bandwidth_bytes_per_s,
                     decode_step_per_seq_s=rank_flops / sustained_flops,
                     decode_step_per_kv_token_s=rank_kv_per_token / chosen.bandwidth_bytes_per_s,
                     gpu_fraction=chosen.gpu_fraction)


@dataclass
class GpuAssignment:
    """One physical GPU: its MIG layout and which model replica runs in each slot (None: free)."""

    layout: str
    slots: list[tuple[str, str | None]] = field(default_factory=list)


def _assign(items: list[tuple[str, str, int]], layout: tuple[str, ...]) -> tuple[list[tuple[str, str | None]], list[int]]:
    # Each replica into a free slot of exactly its planned profile, so every replica of a model asks
    # Ray and Kubernetes for the same MIG resource.
    slots: list[tuple[str, str | None]] = [(name, None) for name in layout]
    placed = []
    for index, (model, profile, _) in enumerate(items):
        for slot, (name, occupant) in enumerate(slots):
            if occupant is None and name == profile:
                slots[slot] = (name, model)
                placed.append(index)
                break
    return slots, placed


def pack(plans: list[ModelPlan], gpu: GpuSpec) -> list[GpuAssignment]:
    """Packs every replica onto GPUs using only the GPU operator's valid layouts.

    Greedy: open one GPU at a time with the layout whose slots the remaining replicas fill most
    (by slot memory; ties: the least memory left idle, then the first listed, all-balanced).
    Whole-GPU plans take one GPU per replica and rank, with MIG disabled; parts of shared GPUs are packed
    as Ray packs them (``_share``).
    """
    items = sorted(((plan.model, plan.slice, plan.need_bytes) for plan in plans for _ in range(plan.replicas)
                    if plan.slice != "gpu" and plan.gpu_fraction == 1), key=lambda item: -item[2])
    # A tensor-parallel replica takes its GPUs whole, one assignment each.
    gpus = [GpuAssignment("all-disabled", [("gpu", plan.model)]) for plan in plans if plan.slice == "gpu"
            for _ in range(plan.replicas * plan.tensor_parallel_size)]
    gpus += _share([plan for plan in plans if plan.gpu_fraction < 1])
    while items:
        best = None
        for name, layout in gpu.layouts.items():
            slots, placed = _assign(items, layout)
            used = sum(gpu.profile(profile).memory_bytes for profile, model in slots if model is not None)
            idle = sum(gpu.profile(profile).memory_bytes for profile, model in slots if model is None)
            key = (used, -idle)
            if placed and (best is None or key > best[0]):
                best = (key, name, slots, placed)
        if best is None:
            raise PlanError(f"{items[0][0]}'s profile {items[0][1]} is in no valid {gpu.name} MIG layout")
        _, name, slots, placed = best
        gpus.append(GpuAssignment(name, slots))
        items = [item for i, item in enumerate(items) if i not in set(placed)]
    return gpus


def _share(plans: list[ModelPlan]) -> list[GpuAssignment]:
    """Parts of shared GPUs, largest first, each onto the first GPU with room (halvings fill GPUs exactly)."""
    smallest = max(SHARED_PARTS)  # the unit a GPU's room is counted in
    parts = sorted(((plan.slice, plan.model, round(1 / plan.gpu_fraction)) for plan in plans
                    for _ in range(plan.replicas)), key=lambda part: part[2])
    gpus: list[GpuAssignment] = []
    free: list[int] = []  # each GPU's free units
    for name, model, num_parts in parts:
        units = smallest // num_parts
        index = next((i for i, room in enumerate(free) if room >= units), None)
        if index is None:
            gpus.append(GpuAssignment("shared"))
            free.append(smallest)
            index = len(gpus) - 1
        gpus[index].slots.append((name, model))
        free[index] -= units
    for assignment, room in zip(gpus, free):
        if room:
            assignment.slots.append((f"{room}/{smallest} free", None))
    return gpus


def plan_config(config: PlatformConfig, gpu: GpuSpec, partitioning: Partitioning, inputs: PlanInputs,
                context_len: int | None = None, concurrency: int | None = None) -> list[ModelPlan]:
    """Plans every model of a platform config (sources resolved as ``fleetserve serve`` would).

    Each model's context defaults to its ``max_model_len`` and its concurrency to its ``max_num_seqs``,
    unless given here; failing both, ``inputs``' values.

    Raises:
        PlanError: for the first model that cannot be read or placed.
    """
    from fleetserve.platform.model_store import ModelSourceError, resolve_source

    plans = []
    for model in config.models:
        try:
            folder = resolve_source(model.source, config_only=True, hub=model.hub_fetch)
        except ModelSourceError as error:
            raise PlanError(f"{model.name}: {error}") from None
        args = model.engine_args
        kv_cache_dtype = str(args.extra.get("kv_cache_dtype", "auto"))
        shape = model_shape(model.name, folder, args.dtype, args.quantization, kv_cache_dtype)
        if model.draft_source is not None:
            shape = replace(shape, draft=_draft_shape(model, kv_cache_dtype))
        targets = replace(inputs, context_len=context_len or args.max_model_len or inputs.context_len,
                          concurrency=concurrency or args.max_num_seqs or inputs.concurrency)
        lora = None if model.lora is None else LoraSlots(model.lora.max_loras, model.lora.max_lora_rank,
                                                         bool(args.extra.get("fully_sharded_loras", False)))
        plan = plan_model(shape, gpu, partitioning, targets, sum(_pool_replicas(model).values()),
                          args.tensor_parallel_size,
                          lora)
        if plan.tensor_parallel_size > 1 and model.disaggregation is not None:
            raise PlanError(f"{model.name} needs {plan.tensor_parallel_size} GPUs per replica (tensor parallelism), "
                            f"which disaggregated models do not support yet: serve it colocated")
        plans.append(plan)
    return plans


def _draft_shape(model: ModelConfig, kv_cache_dtype: str) -> ModelShape:
    """The shape of the model's speculative decoding draft, served in the model's dtype as vLLM serves it."""
    from fleetserve.platform.model_store import ModelSourceError, resolve_source

    spec = model.engine_args.speculative_config or {}
    try:
        folder = resolve_source(str(model.draft_source), config_only=True, hub=model.draft_hub_fetch)
    except ModelSourceError as error:
        raise PlanError(f"{model.name}: engine_args.speculative_config.model: {error}") from None
    return model_shape(f"{model.name} (draft)", folder, model.engine_args.dtype, spec.get("quantization"),
                       spec.get("kv_cache_dtype") or kv_cache_dtype)


def _pool_replicas(model: ModelConfig, at_most: bool = True) -> dict[str, int]:
    """Replicas per pool: the autoscaling maximum (``at_most``) or the initial count."""
    counts = {}
    for pool in model.pools():
        config = model.pool_model(pool)
        scaling = config.autoscaling
        counts[pool] = scaling.max_replicas if at_most and scaling is not None else config.replicas
    return counts


def group_name(pool: str, slice_name: str) -> str:
    """A worker group's name: the pool and the slice, DNS-1123 safe (``colocated-3g-40gb``)."""
    return f"{pool}-{slice_name.replace('.', '-')}"


def chart_values(config: PlatformConfig, plans: list[ModelPlan], gpu: GpuSpec,
                 partitioning: Partitioning) -> dict[str, Any]:
    """Values for helm/fleetserve: the platform config with each model pinned to its slice, and one
    worker group per slice with as many pods as replicas planned on it (parts of shared GPUs: as many
    one-GPU pods as their parts fill)."""
    mig = partitioning is Partitioning.MIG
    by_model = {plan.model: plan for plan in plans}
    platform = config.model_dump(mode="json", exclude_defaults=True)
    groups: dict[str, dict[str, Any]] = {}
    # Per group, the pods its replicas fill at first and at most: a pod each, or a part of one on a shared GPU.
    num_pods: dict[str, list[float]] = {}
    for entry in platform["models"]:
        plan = by_model[entry["name"]]
        # On a GPU this sizes the KV pool: what the slice leaves after the weights (vLLM's
        # gpu_memory_utilization would instead size it from the whole device it sees).
        engine_args = entry.setdefault("engine_args", {})
        engine_args["kv_cache_memory_bytes"] = plan.kv_cache_bytes_per_gpu
        if plan.tensor_parallel_size > 1:
            engine_args["tensor_parallel_size"] = plan.tensor_parallel_size
        resources = entry.setdefault("resources", {})
        shared = plan.gpu_fraction < 1
        # A part of a GPU: Ray packs such replicas onto one GPU, and each engine keeps to that part of its memory.
        resources.update({"num_gpus": plan.gpu_fraction if shared else plan.tensor_parallel_size})
        # CPU core pins mean nothing to a GPU engine; a pool's own pins would outlive the model's otherwise.
        pools = entry.get("disaggregation") or {}
        for pins in (resources, pools.get("prefill") or {}, pools.get("decode") or {}):
            pins.pop("cpu_binding", None)
        if mig:
            resources["custom_resources"] = {f"{RAY_MIG_RESOURCE_PREFIX}{plan.slice}": 1}
        model = config.model(plan.model)
        # Both pools of a disaggregated model share its slice size, so they share one worker group: Ray
        # places prefill and decode replicas on any pod offering the slice's resource.
        # Pods of a tensor-parallel model hold all its ranks' GPUs: a group of their own per GPU count.
        where = (plan.slice if mig else "shared-gpu" if shared
                 else "gpu" if plan.tensor_parallel_size == 1 else f"{plan.tensor_parallel_size}gpu")
        name = group_name("colocated" if model.disaggregation is None else "disaggregated", where)
        group = groups.setdefault(name, {"migProfile": plan.slice if mig else "", "replicas": 0, "minReplicas": 0,
                                         "maxReplicas": 0, "cpu": "8", "memory": "32Gi"})
        if plan.tensor_parallel_size > 1:
            group["numGpus"] = plan.tensor_parallel_size
        counts = num_pods.setdefault(name, [0.0, 0.0])
        counts[0] += plan.gpu_fraction * sum(_pool_replicas(model, at_most=False).values())
        counts[1] += plan.gpu_fraction * plan.replicas
        # Host memory to stage the weights while loading: 1.5x the weights, at least 32 GiB.
        memory_gib = max(32, math.ceil(plan.weight_bytes * 1.5 / GiB))
        group["memory"] = f"{max(memory_gib, int(group['memory'].removesuffix('Gi')))}Gi"
    for name, (initial, most) in num_pods.items():
        groups[name].update({"replicas": math.ceil(initial), "maxReplicas": math.ceil(most)})
    return {"platform": platform, "gpu": {"migStrategy": "mixed" if mig else "none", "product": gpu.product},
            "workerGroups": groups}
