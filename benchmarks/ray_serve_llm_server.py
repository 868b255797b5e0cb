"""Ray Serve LLM (`ray.serve.llm.build_openai_app`) on CPU, for benchmarks/serve_vs_vllm.py.

    python benchmarks/ray_serve_llm_server.py MODEL_JSON PORT CORES

MODEL_JSON is a fleetserve model entry; its engine args go to Ray Serve LLM's vLLM engine unchanged, so the
three servers the benchmark compares run the same engine. Prints READY once it serves; Ctrl-C stops it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading


def main() -> None:
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from fleetserve.platform.config import ModelConfig
    from fleetserve.platform.model_store import resolve_source

    model = ModelConfig.model_validate(json.loads(sys.argv[1]))
    port, cores = int(sys.argv[2]), sys.argv[3]
    config = LLMConfig(
        model_loading_config={"model_id": model.name, "model_source": str(resolve_source(model.source))},
        engine_kwargs=model.engine_kwargs(),
        accelerator_config={"kind": "cpu"},
        # The engine's worker on the same cores as the other servers' (read when vLLM spawns it).
        runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": cores}},
        deployment_config={"num_replicas": 1})
    # Logical CPUs only gate scheduling: Ray Serve LLM asks a whole one for its ingress and its engine's
    # placement group, more than the 2 Ray detects here; the engine's cores are pinned above.
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=8)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_openai_app({"llm_configs": [config]}), name="ray-serve-llm", route_prefix="/")
    print("READY", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
