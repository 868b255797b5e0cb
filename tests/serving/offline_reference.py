"""Greedy outputs from vLLM's offline ``LLM`` for model entries, as JSON on stdout.

Run as a subprocess by the equality tests, so its engines' memory is freed when it exits; one process
serves every model, so vLLM is imported once:
    python offline_reference.py MODEL_ENTRIES_JSON CASES_JSON
CASES_JSON: {"completions": [prompt, ...], "chats": [[message, ...], ...], "max_tokens": N}
Prints ``REFERENCE {model name: {"completions": [...], "chats": [...]}}``.
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    from fleetserve.platform.config import ModelConfig
    from fleetserve.platform.model_store import resolve_source

    cases = json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    params = SamplingParams(temperature=0, max_tokens=cases["max_tokens"])
    references = {}
    for entry in json.loads(sys.argv[1]):
        model = ModelConfig.model_validate(entry)
        llm = LLM(model=str(resolve_source(model.source)), **model.engine_kwargs())
        completions = [out.outputs[0].text for out in llm.generate(cases["completions"], params, use_tqdm=False)]
        chats = [llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text for messages in cases["chats"]]
        llm.llm_engine.engine_core.shutdown()
        del llm
        references[model.name] = {"completions": completions, "chats": chats}
    print("REFERENCE " + json.dumps(references), flush=True)


if __name__ == "__main__":
    main()
