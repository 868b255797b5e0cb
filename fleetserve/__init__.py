"""fleetserve: many LLMs on Ray Serve behind one OpenAI-compatible, routed endpoint.

Packages, lowest layer first (the order import-linter enforces, see pyproject.toml):

* ``platform``: the Ray-free core: configs, the vLLM engine and its OpenAI app, the contracts between layers.
* ``router.model`` (cost/quality: which model) and ``router.replica`` (which replica of it).
* ``autoscaler``: per-pool scaling policies and their simulator.
* ``deployments``: the Ray Serve application (ingress, engine replicas, disaggregated pools, builders).
* ``loadtest``: a load tester that speaks only HTTP to any OpenAI server.
* ``ops``: Kubernetes (RayService via Helm), the capacity planner and status views.
* ``cli``: every ``fleetserve`` command.
"""
