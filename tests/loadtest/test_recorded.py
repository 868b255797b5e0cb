"""Recorded traces: CSV parsing with exact arrivals, rate scaling, windows and errors that name the row."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.loadtest.recorded import TraceError, TraceRequest, from_csv, window

AZURE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


AZURE_SHAPED = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.5000000,100,10
2023-11-16 18:15:47.0000000,200,0
2023-11-16 18:15:48.5000000,300,30
"""


def test_azure_rows_become_arrivals_from_zero_with_their_token_counts(tmp_path):
    trace = from_csv(write(tmp_path, AZURE_SHAPED))
    # 46.5 s is time 0; 47.0 s is 0.5 s later, 48.5 s is 2.0 s; no output becomes one token (one step to answer).
    assert trace == [TraceRequest(0.0, 100, 10), TraceRequest(0.5, 200, 1), TraceRequest(2.0, 300, 30)]


def test_rate_scale_compresses_time(tmp_path):
    trace = from_csv(write(tmp_path, AZURE_SHAPED), rate_scale=2.0)
    # Twice the rate: arrivals 0, 0.5, 2.0 s become 0, 0.25, 1.0 s.
    assert [r.arrival_s for r in trace] == [0.0, 0.25, 1.0]


def test_numeric_seconds_and_other_column_names_are_read_in_any_order(tmp_path):
    trace = from_csv(write(tmp_path, "output_tokens,arrival_s,prompt_tokens\n5,12.5,40\n7,10,30\n"))
    # Sorted by arrival, from the earliest (10 s).
    assert trace == [TraceRequest(0.0, 30, 7), TraceRequest(2.5, 40, 5)]


@pytest.mark.parametrize("text, message", [
    ("TIMESTAMP,ContextTokens\n1,2\n", "no 'generatedtokens' column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\nyesterday,4,5\n", "trace.csv:3: expected a timestamp"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2.5,3\n", "trace.csv:2: expected a timestamp"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,0,3\n", "trace.csv:2: token counts must be positive"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "has no requests"),
    ("", "is empty"),
])
def test_bad_traces_are_refused_naming_the_problem(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        from_csv(write(tmp_path, text))


def test_a_non_positive_rate_scale_is_refused(tmp_path):
    with pytest.raises(TraceError, match="rate_scale must be positive"):
        from_csv(write(tmp_path, AZURE_SHAPED), rate_scale=0)


def test_window_keeps_its_span_shifted_to_zero():
    trace = [TraceRequest(float(t), 10, 1) for t in range(10)]
    # [3, 6): arrivals 3, 4, 5, shifted by -3.
    assert [r.arrival_s for r in window(trace, 3.0, 3.0)] == [0.0, 1.0, 2.0]


@pytest.mark.skipif(not AZURE.exists(), reason="../shared/data/traces is absent")
@pytest.mark.parametrize("name, num_requests", [("conv", 19_366), ("code", 8_819)])
def test_azure_traces_read_whole(name, num_requests):
    trace = from_csv(AZURE / f"AzureLLMInferenceTrace_{name}.csv")
    # The counts the data's README gives; each trace spans just under an hour.
    assert len(trace) == num_requests
    assert 3000 < trace[-1].arrival_s < 3600
