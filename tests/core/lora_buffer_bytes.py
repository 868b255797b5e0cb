"""Prints the bytes of LoRA buffers vLLM allocates for a model: ``python lora_buffer_bytes.py FOLDER DTYPE
MAX_LORAS MAX_LORA_RANK`` -> ``LORA_BYTES <n>``. Run in its own process: it starts an engine in process."""

import os
import sys

import torch


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, to read its model
    from vllm import LLM

    folder, dtype, max_loras, max_lora_rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=folder, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
              enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
    model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    storages: dict[int, int] = {}  # a buffer's views (the embedding's 2-D one) share its storage: count it once
    for module in model.modules():
        for name, value in vars(module).items():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            for tensor in tensors:
                if "lora_" in name and isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    print(f"LORA_BYTES {sum(storages.values())}")


if __name__ == "__main__":
    main()
