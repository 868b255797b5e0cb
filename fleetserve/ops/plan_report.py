"""How ``fleetserve plan`` shows a plan: tables for people, JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.table import Table

from fleetserve.ops.planner import GiB, GpuAssignment, ModelPlan, Partitioning, PlanInputs

# How the packing table's title describes the GPUs.
_PACKING_TITLES = {Partitioning.MIG: "valid MIG layouts only", Partitioning.WHOLE: "MIG off",
                   Partitioning.SHARED: "MIG off, small models on parts of shared GPUs"}


def plan_table(plans: list[ModelPlan], gpu_name: str, inputs: PlanInputs) -> Table:
    table = Table(title=f"capacity plan on {gpu_name} (${inputs.price_per_gpu_hour:.2f}/GPU-hour, "
                        f"{inputs.memory_utilization:.0%} of slice memory, {inputs.activation_reserve_bytes / GiB:.1f} "
                        f"GiB activation reserve)")
    with_lora = any(plan.lora_bytes_per_gpu for plan in plans)
    columns = ["model", "replicas", "params", "weights", *(["LoRA/GPU"] if with_lora else []), "KV/token", "need",
               "slice", "max seqs", "decode tok/s (1 / target)", "cold start", "$/1M out"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "slice") else "right")
    for plan in plans:
        lora = [f"{plan.lora_bytes_per_gpu / 2**20:,.0f} MiB"] if with_lora else []
        table.add_row(plan.model, str(plan.replicas), f"{plan.num_params / 1e9:.2f} B", f"{plan.weight_bytes / GiB:.1f} GiB",
                      *lora, f"{plan.kv_bytes_per_token / 1024:.0f} KiB", f"{plan.need_bytes / GiB:.1f} GiB",
                      slice_text(plan), str(plan.max_concurrent_seqs),
                      f"{plan.single_stream_tokens_per_s:,.0f} / {plan.decode_tokens_per_s:,.0f}",
                      f"{plan.cold_start_s:.0f} s", f"${plan.cost_per_million_output_tokens:.3f}")
    return table


def slice_text(plan: ModelPlan) -> str:
    """Where one replica runs: a MIG profile, ``gpu``, or ``4 x gpu (TP 4)`` for a sharded one."""
    if plan.tensor_parallel_size == 1:
        return plan.slice
    return f"{plan.tensor_parallel_size} x {plan.slice} (TP {plan.tensor_parallel_size})"


def packing_table(assignments: list[GpuAssignment], partitioning: Partitioning = Partitioning.MIG) -> Table:
    table = Table(title=f"{len(assignments)} GPU(s), {_PACKING_TITLES[partitioning]}")
    for column in ("GPU", "layout", "slots (profile: model)"):
        table.add_column(column)
    for index, gpu in enumerate(assignments):
        slots = ", ".join(f"{profile}: {model or '—'}" for profile, model in gpu.slots)
        table.add_row(str(index), gpu.layout, slots)
    return table


def plan_json(plans: list[ModelPlan], assignments: list[GpuAssignment], gpu_name: str, partitioning: Partitioning,
              inputs: PlanInputs) -> dict[str, Any]:
    return {"gpu": gpu_name, "mig": partitioning is Partitioning.MIG, "partitioning": partitioning.value,
            "inputs": asdict(inputs), "models": [asdict(plan) for plan in plans],
            "gpus": [{"layout": gpu.layout, "slots": [{"profile": p, "model": m} for p, m in gpu.slots]}
                     for gpu in assignments]}
