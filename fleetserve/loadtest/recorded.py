"""Recorded request traces: one request per row of a CSV, with its arrival time, prompt tokens and output
tokens (Azure's LLM inference traces have this shape). The autoscaling simulator replays them; ``fleetserve
bench`` sends them to a live server, with prompts of the recorded lengths."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives and how much work it is."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


# Column names accepted for each field of a trace CSV, lower-cased (Azure's names first).
TIMESTAMP_COLUMNS = ("timestamp", "time", "arrival_s")
PROMPT_COLUMNS = ("contexttokens", "prompt_tokens", "input_tokens")
OUTPUT_COLUMNS = ("generatedtokens", "output_tokens", "completion_tokens")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, and the row where one is at fault."""


def _column(header: list[str], names: tuple[str, ...], path: Path) -> int:
    lowered = [name.strip().lower() for name in header]
    for name in names:
        if name in lowered:
            return lowered.index(name)
    raise TraceError(f"{path}: no {names[0]!r} column (any of {', '.join(names)}); header is {header}")


def _seconds(value: str) -> float:
    """A timestamp as seconds: a number of seconds, or an ISO date-time (fractions beyond microseconds cut)."""
    try:
        return float(value)
    except ValueError:
        pass
    date, _, fraction = value.strip().partition(".")
    return datetime.fromisoformat(date).timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def from_csv(path: Path, rate_scale: float = 1.0) -> list[TraceRequest]:
    """A recorded trace: one request per row, with a timestamp, prompt tokens and output tokens.

    Timestamps are seconds or ISO date-times; arrivals start at 0. ``rate_scale`` multiplies the request
    rate by compressing time (2.0 plays an hour in 30 minutes), to load a given fleet.

    Raises:
        TraceError: a missing column, or a row whose time or token counts cannot be read (named by line).
    """
    if rate_scale <= 0:
        raise TraceError(f"rate_scale must be positive, got {rate_scale:g}")
    try:
        handle = path.open(newline="")
    except OSError as error:
        raise TraceError(f"cannot read {path}: {error}") from None
    with handle:
        rows = csv.reader(handle)
        header = next(rows, None)
        if header is None:
            raise TraceError(f"{path} is empty")
        columns = [_column(header, names, path) for names in (TIMESTAMP_COLUMNS, PROMPT_COLUMNS, OUTPUT_COLUMNS)]
        parsed = []
        for line, row in enumerate(rows, start=2):
            if not row:
                continue
            try:
                at, prompt, output = (row[index] for index in columns)
                arrival, prompt_tokens, output_tokens = _seconds(at), int(prompt), int(output)
            except (IndexError, ValueError):
                raise TraceError(f"{path}:{line}: expected a timestamp and two token counts, got {row}") from None
            if prompt_tokens < 1 or output_tokens < 0:
                raise TraceError(f"{path}:{line}: token counts must be positive (prompt {prompt_tokens}, "
                                 f"output {output_tokens})")
            parsed.append((arrival, prompt_tokens, output_tokens))
    if not parsed:
        raise TraceError(f"{path} has no requests")
    start = min(arrival for arrival, _, _ in parsed)
    # A request that generated nothing still took a step to answer: count one token, as from_bench does.
    return sorted((TraceRequest((arrival - start) / rate_scale, prompt, max(1, output))
                   for arrival, prompt, output in parsed), key=lambda r: r.arrival_s)


def window(trace: list[TraceRequest], start_s: float, duration_s: float) -> list[TraceRequest]:
    """The requests arriving in ``[start_s, start_s + duration_s)``, shifted to start at 0."""
    return [TraceRequest(r.arrival_s - start_s, r.prompt_tokens, r.output_tokens) for r in trace
            if start_s <= r.arrival_s < start_s + duration_s]


