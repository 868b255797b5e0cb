"""Routed traffic recorded by the ingress, and feedback on its responses, as rotated JSONL files.

A platform's own prompts are the data its router should learn from and be calibrated on (MMLU is
not anyone's traffic). The ingress appends one ``route`` record per routed request of a tenant
that opted in, and one ``feedback`` record per ``POST /v1/feedback``; ``fleetserve router label``
turns recorded prompts into battles and ``fleetserve router calibrate --records`` calibrates on
them. Tenants are recorded only as an unsalted sha256 prefix of their name: enough to join
feedback to its request, not enough to print who sent what.

Each ingress process writes its own file in the recording folder (``routed-<host>-<pid>.jsonl``), so
several ingress replicas never rotate one another's files. Writing goes through
``logging.handlers.RotatingFileHandler``, which rotates by size (``.jsonl.1``, ``.jsonl.2``, ...) and is
safe across the ingress's threads. Readers take the folder (every process's files) or one file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

RecordType = Literal["route", "feedback"]


def tenant_hash(tenant: str) -> str:
    """The 16-hex-digit sha256 prefix recorded in place of a tenant's name."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RouteRecord:
    """One routed request, as recorded."""

    request_id: str
    # sha256 prefix of the tenant's name ("anonymous" when auth is off).
    tenant: str
    # The routed name the client sent (e.g. "auto").
    route: str
    # The text the router read (route_on), the prompt to learn from.
    prompt: str
    # The served model the route chose, and its tier index (the last is the strongest).
    model: str
    tier_index: int
    strongest: bool
    # The predicted P(strongest beats the chosen tier); None at threshold 0 or out of domain.
    win_rate: float | None
    # RouteReason value.
    reason: str
    time: float
    type: RecordType = "route"


@dataclass(frozen=True)
class FeedbackRecord:
    """A client's score of one response, 0 (bad) to 1 (good)."""

    request_id: str
    tenant: str
    score: float
    time: float
    type: RecordType = "feedback"


class TrafficRecorder:
    """Appends records to this process's size-rotated JSONL file in a folder.

    Args:
        directory: the recording folder.
        max_bytes: size at which the live file is rotated.
        num_backups: rotated copies kept; older ones are deleted.
        name: the live file's name; by default ``routed-<host>-<pid>.jsonl``, one per process.
    """

    def __init__(self, directory: str | Path, max_bytes: int, num_backups: int, name: str | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / (name or f"routed-{socket.gethostname()}-{os.getpid()}.jsonl")
        self._handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=max_bytes, backupCount=num_backups,
                                                             encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def _write(self, record: RouteRecord | FeedbackRecord) -> None:
        line = json.dumps(asdict(record), ensure_ascii=False)
        self._handler.emit(logging.LogRecord("fleetserve.traffic", logging.INFO, str(self.path), 0, line, None, None))

    def record_route(self, request_id: str, tenant: str, route: str, prompt: str, model: str, tier_index: int,
                     strongest: bool, win_rate: float | None, reason: str) -> RouteRecord:
        """Appends one routed request; returns the record written."""
        record = RouteRecord(request_id, tenant_hash(tenant), route, prompt, model, tier_index, strongest, win_rate,
                             reason, time.time())
        self._write(record)
        return record

    def record_feedback(self, request_id: str, tenant: str, score: float) -> FeedbackRecord:
        """Appends one feedback score; returns the record written."""
        record = FeedbackRecord(request_id, tenant_hash(tenant), score, time.time())
        self._write(record)
        return record

    def close(self) -> None:
        self._handler.close()


def record_files(path: str | Path) -> list[Path]:
    """The files to read: a live file and its rotated copies (oldest first), or a folder's, per live file."""
    path = Path(path)
    if path.is_dir():
        return [file for live in sorted(path.glob("*.jsonl")) for file in record_files(live)]
    rotated = [p for p in path.parent.glob(f"{path.name}.*") if p.suffix[1:].isdigit()]
    return sorted(rotated, key=lambda p: int(p.suffix[1:]), reverse=True) + ([path] if path.exists() else [])


def read_records(path: str | Path) -> Iterator[RouteRecord | FeedbackRecord]:
    """Every record of a recording folder, or of one live file and its rotated copies, oldest first per file.

    Raises:
        ValueError: naming the file and line of a record that is not one of ours.
    """
    files = record_files(path)
    if not files:
        raise ValueError(f"{path}: no recorded traffic (neither the file nor rotated copies exist)")
    for file in files:
        for line_number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                kind = data.pop("type")
                yield RouteRecord(**data) if kind == "route" else FeedbackRecord(**data)
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{file}:{line_number}: not a fleetserve traffic record ({error})") from None
