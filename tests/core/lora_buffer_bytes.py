"""Prints the bytes of LoRA buffers vLLM allocates for a model on each tensor-parallel rank:
``python lora_buffer_bytes.py FOLDER DTYPE MAX_LORAS MAX_LORA_RANK [NUM_RANKS [fully_sharded]]`` ->
``LORA_BYTES <n> [<n> ...]``.
Run in its own process: it starts an engine in process (its ranks in worker processes, one CPU core each)."""

import os
import sys

import torch


def lora_bytes(worker) -> int:
    """The bytes of one rank's LoRA tensors (run on each worker by ``collective_rpc``)."""
    storages: dict[int, int] = {}  # a buffer's views (the embedding's 2-D one) share its storage: count it once
    for module in worker.model_runner.model.modules():
        for name, value in vars(module).items():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            for tensor in tensors:
                if "lora_" in name and isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    folder, dtype, max_loras, max_lora_rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    num_ranks = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    fully_sharded = sys.argv[6:] == ["fully_sharded"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc pickles lora_bytes to the workers
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(num_ranks))
    from vllm import LLM

    llm = LLM(model=folder, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
              enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank, tensor_parallel_size=num_ranks,
              distributed_executor_backend="mp" if num_ranks > 1 else None, fully_sharded_loras=fully_sharded)
    print("LORA_BYTES", *llm.collective_rpc(lora_bytes))


if __name__ == "__main__":
    main()
