"""The OpenAI-compatible front door, in the ingress replica's process.

* ``server``: request handling: reads a request's few fields, picks the model, forwards the bytes.
* ``request_fields``: the strict JSON parse and the fields the ingress reads.
* ``limits``: per-request limits, admission control (``admission``), in-flight counts and progress timeouts.
* ``security``: API keys, tenants and their rate limits.
* ``model_clients``: how the ingress reaches a model's engines (a Serve handle, or an in-process server).
* ``streaming``: engine failures as OpenAI errors, and relaying a replica's stream to the client.
* ``protocol``: OpenAI error JSON and fleetserve's response headers; ``metrics``: the ingress's own metrics.
"""
