"""Routing, in two independent halves.

* ``router.model``: cost/quality routing (RouteLLM-style): which served model answers a routed name.
* ``router.replica``: replica routing: which replica of a model, aware of prefix caches and load.
"""
