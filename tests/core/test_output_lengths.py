"""Output lengths in log-spaced buckets: the edges, the bucket of a length and the length standing for a bucket."""

from __future__ import annotations

import math

import pytest

from fleetserve.platform.output_lengths import (
    NUM_OUTPUT_LENGTH_BUCKETS,
    OUTPUT_LENGTH_EDGES,
    bucket_index,
    bucket_lengths,
    count_lengths,
)


def test_edges_are_exact_for_short_answers_then_about_sqrt2_apart():
    # round(2 ** (k / 2)) for k = 0..30, duplicates dropped: 1, 1, 2, 3, 4, 6, 8, 11, ... 32768.
    assert OUTPUT_LENGTH_EDGES[:8] == (1, 2, 3, 4, 6, 8, 11, 16)
    assert (OUTPUT_LENGTH_EDGES[-1], NUM_OUTPUT_LENGTH_BUCKETS) == (32768, 30)


@pytest.mark.parametrize("num_tokens, index", [(0, 0), (1, 0), (2, 1), (4, 3), (5, 3), (6, 4), (15, 6), (16, 7),
                                               (32767, 28), (32768, 29), (10**6, 29)])
def test_a_length_falls_in_the_last_edge_at_or_below_it(num_tokens, index):
    assert bucket_index(num_tokens) == index


def test_a_bucket_stands_for_the_geometric_mean_of_its_lengths():
    lengths = bucket_lengths()
    # [1, 2) -> 1, [4, 6) -> sqrt(4 x 5), [11, 16) -> sqrt(11 x 15); the open last bucket -> its edge.
    assert (lengths[0], lengths[3], lengths[6], lengths[-1]) == (1.0, math.sqrt(20), math.sqrt(165), 32768.0)


def test_count_lengths_counts_each_bucket():
    counts = count_lengths([1, 7, 7, 9, 500])
    # 7, 7 -> [6, 8); 9 -> [8, 11); 500 -> [362, 512).
    assert (counts[0], counts[4], counts[5], counts[OUTPUT_LENGTH_EDGES.index(362)], sum(counts)) == (1, 2, 1, 1, 5)
