"""Replica routing: which replica of one model serves a request.

``policy`` holds the policies (cache-aware, session affinity, least loaded, round robin, power of two);
each sees ``policy.ReplicaLoad`` per replica (outstanding requests, KV usage) and what each replica is
believed to cache (``prefix_index``, or the engines' own ``kv_events``). The contract is
``policy.ReplicaPolicy``. Only ``serve_adapter`` imports Ray: it runs a policy as Ray Serve's request router.
"""
