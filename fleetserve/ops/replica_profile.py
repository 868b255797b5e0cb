"""A planned replica as the autoscaling simulator's replica profile: the plan's arithmetic, handed on.

``fleetserve plan --emit-profiles`` writes one per model, so a trace can be replayed on the slices a plan
chose (``fleetserve autoscale simulate --profile``) before any GPU exists. The figures are derived from
datasheets, not measured: ``benchmarks/autoscaling.py calibrate`` measures a real engine.
"""

from __future__ import annotations

from fleetserve.ops.gpus import GpuSpec
from fleetserve.ops.planner import GiB, ModelPlan
from fleetserve.platform.config import ModelConfig, ReplicaProfile
from fleetserve.platform.config.model import VLLM_MAX_DEFAULT_NUM_SEQS


def vllm_batch_defaults(device_memory_bytes: int, gpu_name: str) -> tuple[int, int]:
    """``max_num_seqs`` and ``max_num_batched_tokens`` an API server's engine gets on a GPU when the config
    leaves them unset (vLLM 0.32, ``EngineArgs.get_batch_defaults``): larger on devices of 70 GiB or more,
    A100s excepted; a MIG instance reports its own memory."""
    if device_memory_bytes >= 160 * GiB:
        return VLLM_MAX_DEFAULT_NUM_SEQS, 16384
    if device_memory_bytes >= 70 * GiB and "a100" not in gpu_name:
        return VLLM_MAX_DEFAULT_NUM_SEQS, 8192
    return 256, 2048


def replica_profile(plan: ModelPlan, model: ModelConfig, gpu: GpuSpec) -> ReplicaProfile:
    """What one replica of ``model`` does where ``plan`` put it: the plan's KV capacity, prefill and decode
    costs and cold start, and the engine's batch limits (the config's, else vLLM's defaults there)."""
    # A MIG instance is a device of its own memory to vLLM; a part of a shared GPU sees the whole GPU.
    mig = plan.slice in {profile.name for profile in gpu.profiles}
    memory = gpu.profile(plan.slice).memory_bytes if mig else gpu.memory_bytes
    default_seqs, default_tokens = vllm_batch_defaults(memory, gpu.name)
    args = model.serving_model().engine_args
    return ReplicaProfile(kv_capacity_tokens=plan.kv_capacity_tokens, prefill_tokens_per_s=plan.prefill_tokens_per_s,
                          decode_step_base_s=plan.decode_step_base_s, decode_step_per_seq_s=plan.decode_step_per_seq_s,
                          decode_step_per_kv_token_s=plan.decode_step_per_kv_token_s,
                          max_num_seqs=args.max_num_seqs or default_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens or default_tokens,
                          startup_s=plan.cold_start_s)


def profile_yaml(profile: ReplicaProfile, plan: ModelPlan, gpu: GpuSpec) -> str:
    """The profile as YAML that ``fleetserve autoscale simulate --profile`` reads, saying where it came from."""
    import yaml

    where = f"{plan.tensor_parallel_size} x {plan.slice}" if plan.tensor_parallel_size > 1 else plan.slice
    return (f"# {plan.model} on {where} of {gpu.name}: derived by `fleetserve plan` from datasheet figures, not\n"
            f"# measured. Replay a trace on it: fleetserve autoscale simulate --profile <this file> ...\n"
            + yaml.safe_dump(profile.model_dump(), sort_keys=False))
