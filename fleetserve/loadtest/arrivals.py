"""Request arrival times: all at once, Poisson, or gamma-distributed bursts (as vLLM's benchmark)."""

from __future__ import annotations

import math

import numpy as np


def inter_arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                        seed: int = 0) -> np.ndarray:
    """Seconds to wait before each request.

    Gamma with shape ``burstiness`` and mean ``1 / request_rate``: burstiness 1 is a Poisson process,
    below 1 is burstier, above 1 more regular. The coefficient of variation is ``1 / sqrt(burstiness)``.
    An infinite rate sends every request at once.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if request_rate <= 0:
        raise ValueError("request rate must be positive (or inf)")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
