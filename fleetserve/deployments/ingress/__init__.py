"""The OpenAI-compatible front door, in the ingress replica's process.

* ``server``: request handling: reads a request's few fields, picks the model, forwards the bytes.
* ``request_fields``: the strict JSON parse and the fields the ingress reads.
* ``admission`` and ``security``: limits, overload protection, API keys and tenants.
* ``streaming``: relaying a replica's stream to the client.
* ``protocol``: OpenAI error JSON and headers.
"""
