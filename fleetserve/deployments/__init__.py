"""The serving layer: the Ray Serve application.

* ``builders.build_app``: a platform config in, the bound Serve application out (the only ``.bind()`` calls).
* ``serve_options``: each deployment's Serve options (replicas, resources, autoscaling, request router),
  emitted from the platform config.
* ``ingress``: the OpenAI-compatible front door.
* ``engine_server``: one engine replica (colocated serving); ``disaggregated``: prefill and decode pools.
* ``metrics_hub``: gathers every replica's metrics for one ``/metrics``.

Each deployment is a plain class (tested without Ray, on an injected engine) plus a thin Serve subclass.
"""
