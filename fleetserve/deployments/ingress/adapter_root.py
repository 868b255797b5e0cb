"""The ingress's view of adapter roots: which base model serves a ``<base>:<folder>`` name.

The ingress loads nothing: the request goes to a replica of the base, which loads the adapter the first time it
serves it (``EngineServer``), and the replica router prefers replicas that hold it, as for any adapter.
"""

from __future__ import annotations

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.platform.adapter_root import SEPARATOR, AdapterNameError, root_folder
from fleetserve.platform.config import ModelConfig


def root_base(name: str, models: dict[str, ModelConfig]) -> str | None:
    """The base model whose adapter root ``name`` names a folder of; None when it names none (no ``:``, no such
    model, or no adapter root on it).

    Raises:
        APIError: 400 when the part after ``:`` is no folder name (a path, or hidden).
    """
    base = name.partition(SEPARATOR)[0]
    config = models.get(base)
    if config is None or config.lora is None or config.lora.adapter_root is None:
        return None
    try:
        return base if root_folder(name, base) is not None else None
    except AdapterNameError as error:
        raise APIError(str(error), 400, param="model", code="invalid_adapter_name") from None
