"""Greedy outputs from vLLM's offline ``LLM`` for model entries, as JSON on stdout.

Run as a subprocess by the equality tests, so its engines' memory is freed when it exits; one process
serves every model, so vLLM is imported once:
    python offline_reference.py MODEL_ENTRIES_JSON CASES_JSON
CASES_JSON: {"completions": [prompt, ...], "chats": [[message, ...], ...], "max_tokens": N,
             "adapters": {model name: {adapter name: source}}}  (adapters optional: more than the configured)
Prints ``REFERENCE {name: {"completions": [...], "chats": [...]}}`` for every model and every adapter (configured
or given), each adapter's outputs from vLLM's own ``LoRARequest``.
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm.lora.request import LoRARequest

    from fleetserve.platform.config import ModelConfig
    from fleetserve.platform.lora_store import resolve_adapter_source
    from fleetserve.platform.model_store import resolve_source

    cases = json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    params = SamplingParams(temperature=0, max_tokens=cases["max_tokens"])
    references = {}
    for entry in json.loads(sys.argv[1]):
        model = ModelConfig.model_validate(entry)
        base_path = resolve_source(model.source)
        llm = LLM(model=str(base_path), **model.engine_kwargs())
        adapters = {**{a.name: a.source for a in (model.lora.adapters if model.lora else [])},
                    **cases.get("adapters", {}).get(model.name, {})}
        runs = {model.name: None} | {
            name: LoRARequest(name, index + 1, str(resolve_adapter_source(source, base_path, model.lora.max_lora_rank)))
            for index, (name, source) in enumerate(sorted(adapters.items()))}
        for name, lora in runs.items():
            completions = [out.outputs[0].text for out in llm.generate(cases["completions"], params, use_tqdm=False,
                                                                        lora_request=lora)]
            chats = [llm.chat(messages, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
                     for messages in cases["chats"]]
            references[name] = {"completions": completions, "chats": chats}
        llm.llm_engine.engine_core.shutdown()
        del llm
    print("REFERENCE " + json.dumps(references), flush=True)


if __name__ == "__main__":
    main()
