"""The load tester (``fleetserve bench``): it measures any OpenAI-compatible server over HTTP only, with
vLLM's ``vllm bench serve`` metrics (TTFT, TPOT, ITL, goodput), datasets, sweeps, plots and comparisons.
"""
