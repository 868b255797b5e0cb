"""Greedy outputs from vLLM's offline ``LLM`` for a model entry, as JSON on stdout.

Run as a subprocess by the equality tests, so its engine's memory is freed when it exits:
    python offline_reference.py MODEL_ENTRY_JSON CASES_JSON
CASES_JSON: {"completions": [prompt, ...], "chats": [[message, ...], ...], "max_tokens": N}
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    from fleetserve.platform.config import ModelConfig
    from fleetserve.platform.model_store import resolve_source

    model = ModelConfig.model_validate(json.loads(sys.argv[1]))
    cases = json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    llm = LLM(model=str(resolve_source(model.source)), **model.engine_args.to_vllm_kwargs())
    params = SamplingParams(temperature=0, max_tokens=cases["max_tokens"])
    completions = [out.outputs[0].text for out in llm.generate(cases["completions"], params, use_tqdm=False)]
    chats = [llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text for messages in cases["chats"]]
    llm.llm_engine.engine_core.shutdown()
    print("REFERENCE " + json.dumps({"completions": completions, "chats": chats}), flush=True)


if __name__ == "__main__":
    main()
