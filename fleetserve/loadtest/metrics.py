"""Benchmark metrics with the names and meanings of vLLM's ``vllm bench serve``, so results compare."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fleetserve.loadtest.client import RequestRecord

# SLO keys accepted by --goodput, in milliseconds.
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
# refusal: how long a refused (429/503) request took to be told so; the others are of completed requests.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "refusal")


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """Parses ``ttft:MS tpot:MS e2el:MS`` into {"ttft": ms, ...}.

    Raises:
        ValueError: an unknown key or a non-positive number.
    """
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"unknown goodput SLO {key!r}; expected one of {', '.join(GOODPUT_KEYS)} as KEY:MS")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: expected KEY:MILLISECONDS") from None
        if slos[key] <= 0:
            raise ValueError(f"goodput SLO {item!r} must be positive")
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or any(not 0 < value <= 100 for value in values):
        raise ValueError("--metric-percentiles takes numbers in (0, 100], e.g. 50,90,99")
    return values


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """DistServe's goodput: a request counts only if it meets every SLO (compared in ms)."""
    values = {"ttft": record.ttft, "tpot": record.tpot if record.output_tokens > 1 else 0.0, "e2el": record.e2el}
    return record.ok and all(values[key] is not None and values[key] * 1000 <= limit for key, limit in slos.items())


@dataclass
class Summary:
    """Distribution summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Summary:
        values = np.asarray(seconds, dtype=float) * 1000
        if values.size == 0:
            return cls(0.0, 0.0, 0.0, {_pname(p): 0.0 for p in percentiles})
        return cls(float(values.mean()), float(np.median(values)), float(values.std()),
                   {_pname(p): float(np.percentile(values, p)) for p in percentiles})


def _pname(percentile: float) -> str:
    return f"p{percentile:g}"


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, percentiles: Sequence[float],
                    goodput_slos: dict[str, float] | None = None) -> dict[str, float | int | None]:
    """The run's figures, flat, with vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
    done = [record for record in records if record.ok]
    total_input = sum(record.prompt_tokens for record in done)
    total_output = sum(record.output_tokens for record in done)
    duration_s = max(duration_s, 1e-9)
    result: dict[str, float | int | None] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        # Failed ones the server turned away (429/503), and of those, how many said when to retry.
        "refused": sum(record.refused for record in records),
        "refused_with_retry_after": sum(record.refused and record.retry_after is not None for record in records),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": (sum(meets_slos(record, goodput_slos) for record in records) / duration_s
                            if goodput_slos else None),
        # Share of prompt tokens the server reported as prefix-cache hits; None if it reports none.
        "prefix_cache_hit_rate": _cache_hit_rate(done),
    }
    samples = {
        "ttft": [record.ttft for record in done if record.ttft is not None],
        "tpot": [record.tpot for record in done if record.tpot is not None],
        "itl": [gap for record in done for gap in record.itl],
        "e2el": [record.e2el for record in done if record.e2el is not None],
        "refusal": [record.e2el for record in records if record.refused and record.e2el is not None],
    }
    for name in LATENCY_METRICS:
        summary = Summary.of(samples[name], percentiles)
        result[f"mean_{name}_ms"] = summary.mean
        result[f"median_{name}_ms"] = summary.median
        result[f"std_{name}_ms"] = summary.std
        for key, value in summary.percentiles.items():
            result[f"{key}_{name}_ms"] = value
    return result


def _cache_hit_rate(done: Sequence[RequestRecord]) -> float | None:
    reported = [record for record in done if record.cached_tokens is not None]
    prompt_tokens = sum(record.prompt_tokens for record in reported)
    return sum(record.cached_tokens for record in reported) / prompt_tokens if prompt_tokens else None


def timeline(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> dict[str, list[float]]:
    """Output tokens/s and requests in flight per time bucket, from each request's chunk times.

    A chunk may carry several tokens; each request's tokens are spread evenly over its chunks.
    """
    ends = [record.start + (record.e2el or 0.0) for record in records]
    horizon = max(ends, default=0.0)
    num_buckets = int(np.ceil(horizon / bucket_s)) + 1
    tokens = np.zeros(num_buckets)
    in_flight = np.zeros(num_buckets)
    for record, end in zip(records, ends, strict=True):
        if record.chunk_times and record.output_tokens:
            per_chunk = record.output_tokens / len(record.chunk_times)
            for moment in record.chunk_times:
                tokens[int(moment / bucket_s)] += per_chunk
        first, last = int(record.start / bucket_s), int(end / bucket_s)
        in_flight[first:last + 1] += 1
    return {"time_s": [index * bucket_s for index in range(num_buckets)],
            "output_tokens_per_s": (tokens / bucket_s).tolist(), "requests_in_flight": in_flight.tolist()}
