"""Cost/quality model routing: which served model answers a routed name.

``quality_router`` holds the routers (RouteLLM's matrix factorization, a classifier, random), trained on
correctness data (``routing_data``) over ``embedders``, and judged by ``evaluation``. ``routes`` resolves a
routed name to a served model per request. The contract between them is ``routes.WinRateRouter``: a
prompt in, the stronger model's predicted win rate out. No Ray.
"""
