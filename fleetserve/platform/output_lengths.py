"""How many tokens finished requests generated, as counts in log-spaced buckets.

Engine replicas report it and the SLO policy reads it: a request's TPOT depends on how many tokens it
spreads the prefills it waits through over, so the share that misses depends on the whole distribution of
output lengths, not its mean (on Azure's conversation trace no answer is shorter than 7 tokens, where an
exponential of the same mean puts 2.3% of them at 5 or fewer).
"""

from __future__ import annotations

import bisect
import math

import numpy as np

# Lower edges of the buckets, a factor of about sqrt(2) apart (exact below 4); the last one is open-ended.
OUTPUT_LENGTH_EDGES: tuple[int, ...] = tuple(sorted({round(2 ** (k / 2)) for k in range(31)}))
NUM_OUTPUT_LENGTH_BUCKETS = len(OUTPUT_LENGTH_EDGES)


def bucket_index(num_tokens: int) -> int:
    """The bucket of a request that generated ``num_tokens`` (0 and 1 both fall in the first)."""
    return max(0, bisect.bisect_right(OUTPUT_LENGTH_EDGES, num_tokens) - 1)


def bucket_lengths() -> np.ndarray:
    """One output length standing for each bucket: the geometric mean of its first and last length (the
    open last bucket: its edge)."""
    highs = [*OUTPUT_LENGTH_EDGES[1:], OUTPUT_LENGTH_EDGES[-1] + 1]
    return np.array([math.sqrt(low * (high - 1)) for low, high in zip(OUTPUT_LENGTH_EDGES, highs)])


def count_lengths(lengths: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Counts per bucket of the given output lengths."""
    counts = [0] * NUM_OUTPUT_LENGTH_BUCKETS
    for length in lengths:
        counts[bucket_index(length)] += 1
    return tuple(counts)
