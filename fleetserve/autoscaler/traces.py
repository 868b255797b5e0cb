"""Request traces for the autoscaling simulator: synthetic shapes, a ``fleetserve bench`` result, or a
recorded production trace (``fleetserve.loadtest.recorded``: CSV of timestamp, prompt tokens, output
tokens, as Azure's LLM inference traces), which ``fleetserve bench`` replays against a live server too."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fleetserve.loadtest.arrivals import inter_arrival_times
from fleetserve.loadtest.recorded import TraceError, TraceRequest, from_csv, window

__all__ = ["TraceError", "TraceRequest", "bursts", "day", "from_bench", "from_csv", "from_rate", "ramp", "synthetic",
           "window"]


def _lengths(rng: np.random.Generator, n: int, mean: int, spread: float) -> np.ndarray:
    # Uniform in mean * [1 - spread, 1 + spread], at least one token.
    low, high = max(1, int(mean * (1 - spread))), max(1, int(mean * (1 + spread)))
    return rng.integers(low, high + 1, n)


def from_rate(rate_at, duration_s: float, prompt_tokens: int, output_tokens: int, spread: float,
               burstiness: float, seed: int, prompt_at=None) -> list[TraceRequest]:
    """Arrivals of a time-varying rate by thinning a gamma process at the peak rate.

    ``prompt_at(t)``, when given, sets the mean prompt length at time t instead of ``prompt_tokens``.
    """
    rng = np.random.default_rng(seed)
    peak = max(rate_at(t) for t in np.linspace(0, duration_s, 1000))
    gaps = inter_arrival_times(int(peak * duration_s * 2) + 10, peak, burstiness, seed)
    times = np.cumsum(gaps)
    times = times[times < duration_s]
    keep = rng.random(len(times)) < np.array([rate_at(t) / peak for t in times])
    times = times[keep]
    if prompt_at is None:
        prompts = _lengths(rng, len(times), prompt_tokens, spread)
    else:
        prompts = np.array([_lengths(rng, 1, prompt_at(t), spread)[0] for t in times], dtype=int)
    outputs = _lengths(rng, len(times), output_tokens, spread)
    return [TraceRequest(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs)]


def ramp(duration_s: float, start_rate: float, end_rate: float, prompt_tokens: int = 256,
         output_tokens: int = 128, spread: float = 0.5, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals whose rate climbs linearly from ``start_rate`` to ``end_rate`` req/s."""
    return from_rate(lambda t: start_rate + (end_rate - start_rate) * t / duration_s, duration_s, prompt_tokens,
                      output_tokens, spread, 1.0, seed)


def bursts(duration_s: float, base_rate: float, burst_rate: float, burst_every_s: float = 120.0,
           burst_length_s: float = 30.0, burstiness: float = 0.5, prompt_tokens: int = 256,
           output_tokens: int = 128, spread: float = 0.5, seed: int = 0,
           burst_prompt_tokens: int | None = None) -> list[TraceRequest]:
    """``base_rate`` with a ``burst_rate`` burst of ``burst_length_s`` every ``burst_every_s``; gamma
    arrivals with shape ``burstiness`` (below 1 is burstier than Poisson). ``burst_prompt_tokens``
    gives burst requests their own prompt length (a RAG batch, say)."""
    def in_burst(t: float) -> bool:
        return (t % burst_every_s) >= burst_every_s - burst_length_s

    def prompt_at(t: float) -> int:
        return burst_prompt_tokens if in_burst(t) and burst_prompt_tokens else prompt_tokens

    return from_rate(lambda t: burst_rate if in_burst(t) else base_rate, duration_s, prompt_tokens, output_tokens,
                      spread, burstiness, seed, prompt_at)


def day(duration_s: float, trough_rate: float, peak_rate: float, prompt_tokens: int = 256,
        output_tokens: int = 128, spread: float = 0.5, seed: int = 0) -> list[TraceRequest]:
    """A day compressed into ``duration_s``: a cosine from the trough at the start to the peak midway."""
    def rate(t: float) -> float:
        return trough_rate + (peak_rate - trough_rate) * (1 - math.cos(2 * math.pi * t / duration_s)) / 2

    return from_rate(rate, duration_s, prompt_tokens, output_tokens, spread, 1.0, seed)


def from_bench(path: Path) -> list[TraceRequest]:
    """The requests of a ``fleetserve bench --save-detailed`` result: start times and token counts.

    Raises:
        ValueError: the file is not a detailed bench result.
    """
    from fleetserve.loadtest.report import load_results

    document = load_results(path)
    requests = []
    for run in document["runs"]:
        records = run.get("records")
        if not records:
            raise ValueError(f"{path} has no per-request records; rerun fleetserve bench with --save-detailed")
        offset = requests[-1].arrival_s if requests else 0.0
        requests += [TraceRequest(offset + r["start"], int(r["prompt_tokens"]), max(1, int(r["output_tokens"])))
                     for r in records]
    return sorted(requests, key=lambda r: r.arrival_s)


def synthetic(spec: str, seed: int = 0) -> list[TraceRequest]:
    """A trace from a short spec: ``ramp:DURATION:START_RATE:END_RATE``,
    ``bursts:DURATION:BASE_RATE:BURST_RATE[:BURSTINESS]`` or ``day:DURATION:TROUGH:PEAK``.

    Raises:
        ValueError: for a malformed spec.
    """
    kind, *numbers = spec.split(":")
    try:
        values = [float(n) for n in numbers]
    except ValueError:
        raise ValueError(f"trace spec {spec!r}: the fields after the kind must be numbers") from None
    shapes = {"ramp": (ramp, 3), "bursts": (bursts, 3), "day": (day, 3)}
    if kind not in shapes or not shapes[kind][1] <= len(values) <= shapes[kind][1] + (kind == "bursts"):
        raise ValueError(f"unknown trace spec {spec!r}; expected ramp:DURATION:START:END, "
                         f"bursts:DURATION:BASE:BURST[:BURSTINESS] or day:DURATION:TROUGH:PEAK")
    function = shapes[kind][0]
    if kind == "bursts" and len(values) == 4:
        return bursts(values[0], values[1], values[2], burstiness=values[3], seed=seed)
    return function(*values, seed=seed)
