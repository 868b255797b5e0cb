"""The Ray-free core: platform configs, the vLLM engine and vLLM's OpenAI app over it, and the small
typed contracts the other layers exchange (``api_types``, ``replica_report``, ``stats``).

Nothing here imports Ray; the serving layer (``fleetserve.deployments``) adds it.
"""
