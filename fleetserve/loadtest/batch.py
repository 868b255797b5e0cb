"""Runs a file of requests in OpenAI's batch format against an endpoint and writes OpenAI's batch output: what
``vllm run-batch`` does on one engine offline, here through the platform's routing, tenants and limits.

Each answer is written as it arrives, one line per request, so a run that stops (Ctrl-C, a crash) resumes
where it stopped and loses nothing. What the front door turns away for load with a ``Retry-After`` (429, 503)
is sent again when it says, for up to ``max_wait_s``; a request not answered, or failed by a proxy (502, 504),
is retried with backoff. Any other answer, an error included, is the line's result.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The paths a line may POST to: OpenAI's batch endpoints, and vLLM's that its run-batch takes.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/messages",
              "/v1/score", "/v1/rerank", "/score", "/rerank", "/classify", "/pooling")
# Answers worth sending again: rate limited, overloaded, and a proxy's gateway errors.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# The longest wait between two tries of one line when the server names none (doubling from the first).
MAX_BACKOFF_S = 60.0


class BatchFileError(ValueError):
    """The batch file cannot run as written; the message names the line and why."""


class BatchLine(BaseModel):
    """One request of an OpenAI batch input file."""

    model_config = ConfigDict(extra="forbid")

    # The caller's name for the request, unique in the file; its output line carries it.
    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    # The API path, one of BATCH_URLS.
    url: str
    # The request body, sent as is (`model` included).
    body: dict[str, Any]


@dataclass
class BatchConfig:
    """Where and how a batch runs."""

    # The server, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped: each line's url holds it).
    base_url: str
    # Lines in flight at once.
    max_concurrency: int = 16
    # Tries after the first for a line not answered, or answered 429, 502, 503 or 504 without a Retry-After.
    max_retries: int = 5
    # The first wait before such a retry; it doubles per try. Also the least wait on a Retry-After.
    retry_base_s: float = 1.0
    # How long a line's refusals for load that name a Retry-After are waited out (any number of them) before
    # its last refusal is its result: a batch tenant is turned away whenever interactive work needs the room.
    max_wait_s: float = 3600.0
    # Per-request timeout.
    timeout_s: float = 600.0
    # Sent as `Authorization: Bearer <key>`; never written out.
    api_key: str | None = field(default=None, repr=False)

    @property
    def root_url(self) -> str:
        base = self.base_url.rstrip("/")
        return base.removesuffix("/v1")


@dataclass
class BatchOutcome:
    """What became of one line."""

    custom_id: str
    # The final answer's status; None when the server never answered (each try failed to connect or timed out).
    status_code: int | None = None
    # The final answer's JSON (its text where it was not JSON).
    body: Any = None
    # The server's x-request-id, to find the request in its logs.
    request_id: str | None = None
    # Why no answer came, when none did.
    error: str | None = None
    num_attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    def to_json(self) -> dict[str, Any]:
        """The line as OpenAI's batch output writes it."""
        response = (None if self.status_code is None else
                    {"status_code": self.status_code, "request_id": self.request_id, "body": self.body})
        error = None if self.error is None else {"code": "no_response", "message": self.error}
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": self.custom_id, "response": response,
                "error": error}


@dataclass
class BatchSummary:
    """A run's totals."""

    num_lines: int = 0
    # Lines the output held already (a resumed run), not sent again.
    num_skipped: int = 0
    # Of those, the ones whose result is no 2xx answer.
    num_skipped_failed: int = 0
    # Final answers per status code; lines without one count under None.
    statuses: Counter = field(default_factory=Counter)
    # Tries beyond each line's first.
    num_retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    # Whether the run stopped before every line had its result.
    stopped: bool = False

    @property
    def num_ok(self) -> int:
        return sum(count for status, count in self.statuses.items() if status is not None and 200 <= status < 300)

    @property
    def num_failed(self) -> int:
        """Lines whose result, from this run or an earlier one, is no 2xx answer."""
        return self.num_done - self.num_ok + self.num_skipped_failed

    @property
    def num_done(self) -> int:
        return sum(self.statuses.values())

    def add(self, outcome: BatchOutcome) -> None:
        self.statuses[outcome.status_code] += 1
        self.num_retries += max(outcome.num_attempts - 1, 0)
        usage = outcome.body.get("usage") if outcome.ok and isinstance(outcome.body, dict) else None
        if isinstance(usage, dict):
            self.prompt_tokens += int(usage.get("prompt_tokens", usage.get("input_tokens")) or 0)
            self.completion_tokens += int(usage.get("completion_tokens", usage.get("output_tokens")) or 0)


def read_batch(path: Path) -> list[BatchLine]:
    """The requests of a batch file, all checked before any is sent.

    Raises:
        BatchFileError: a line is no JSON or no batch request, names a path no engine serves, asks to stream, or
            repeats an earlier line's custom_id.
    """
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    with path.open() as file:
        for number, text in enumerate(file, start=1):
            if not text.strip():
                continue
            line = _parse_line(text, number)
            if line.custom_id in seen:
                raise BatchFileError(f"line {number}: custom_id {line.custom_id!r} is line {seen[line.custom_id]}'s "
                                     f"too; each request needs its own")
            seen[line.custom_id] = number
            lines.append(line)
    if not lines:
        raise BatchFileError(f"{path} holds no requests")
    return lines


def _parse_line(text: str, number: int) -> BatchLine:
    try:
        line = BatchLine.model_validate_json(text)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in error.errors())
        raise BatchFileError(f"line {number}: {problems}") from None
    if line.url not in BATCH_URLS:
        raise BatchFileError(f"line {number}: url {line.url!r} is not a path a batch can run: {', '.join(BATCH_URLS)}")
    if line.body.get("stream"):
        raise BatchFileError(f"line {number}: body.stream is true; a batch's answers are whole responses")
    return line


def done_ids(output: Path) -> dict[str, bool]:
    """The custom_ids an earlier run wrote to ``output``, each with whether its answer was a 2xx. A last line cut
    short by a crash is removed, so its request runs again."""
    if not output.exists():
        return {}
    ids, kept = {}, 0
    with output.open("rb") as file:
        for raw in file:
            try:
                written = json.loads(raw)
                ids[written["custom_id"]] = 200 <= ((written.get("response") or {}).get("status_code") or 0) < 300
            except (ValueError, KeyError, TypeError, AttributeError):
                break
            kept += len(raw)
    if kept < output.stat().st_size:
        with output.open("r+b") as file:
            file.truncate(kept)
    return ids


async def run_batch(config: BatchConfig, lines: list[BatchLine], output: Path,
                    on_done: Callable[[BatchOutcome], None] | None = None, stop: asyncio.Event | None = None,
                    transport: httpx.AsyncBaseTransport | None = None) -> BatchSummary:
    """Sends each line not yet in ``output`` and appends its result there as soon as it arrives.

    Args:
        config: where and how.
        lines: the requests (``read_batch``).
        output: the JSONL to append to; the lines it holds already are skipped.
        on_done: called with each line's outcome once it is written.
        stop: when set, no further line starts and those in flight are abandoned (a resumed run sends them).
        transport: an httpx transport in place of the network (tests).

    Returns:
        The run's totals.
    """
    done = done_ids(output)
    pending: asyncio.Queue[BatchLine] = asyncio.Queue()
    for line in lines:
        if line.custom_id not in done:
            pending.put_nowait(line)
    skipped = [done[line.custom_id] for line in lines if line.custom_id in done]
    summary = BatchSummary(num_lines=len(lines), num_skipped=len(skipped), num_skipped_failed=skipped.count(False))
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=config.root_url, headers=headers, timeout=config.timeout_s,
                                 limits=limits, transport=transport) as client:
        with output.open("a") as out:
            async def worker() -> None:
                while not pending.empty() and not (stop is not None and stop.is_set()):
                    outcome = await _send(client, config, pending.get_nowait())
                    out.write(json.dumps(outcome.to_json()) + "\n")
                    out.flush()
                    summary.add(outcome)
                    if on_done is not None:
                        on_done(outcome)

            workers = [asyncio.ensure_future(worker()) for _ in range(config.max_concurrency)]
            everything = asyncio.gather(*workers)
            stopping = asyncio.ensure_future(stop.wait() if stop is not None else asyncio.Event().wait())
            try:
                await asyncio.wait([everything, stopping], return_when=asyncio.FIRST_COMPLETED)
                if everything.done():
                    everything.result()  # a worker's error (the output unwritable) ends the run
            finally:
                for task in (*workers, stopping):
                    task.cancel()
                await asyncio.gather(everything, stopping, return_exceptions=True)
    summary.seconds = time.monotonic() - started
    summary.stopped = summary.num_skipped + summary.num_done < summary.num_lines
    return summary


async def _send(client: httpx.AsyncClient, config: BatchConfig, line: BatchLine) -> BatchOutcome:
    outcome = BatchOutcome(line.custom_id)
    deadline = time.monotonic() + config.max_wait_s
    num_failures = 0
    while True:
        outcome.num_attempts += 1
        response = await _post(client, line, outcome)
        if response is not None and response.status_code not in RETRY_STATUSES:
            return outcome
        server_wait = _retry_after(response) if response is not None else None
        if server_wait is not None:  # a refusal for load that says when to come back: waited out
            wait = max(server_wait, config.retry_base_s)
            if time.monotonic() + wait > deadline:
                return outcome
        elif num_failures < config.max_retries:
            wait = min(config.retry_base_s * 2 ** num_failures, MAX_BACKOFF_S)
            num_failures += 1
        else:
            return outcome
        await asyncio.sleep(wait)


async def _post(client: httpx.AsyncClient, line: BatchLine, outcome: BatchOutcome) -> httpx.Response | None:
    """One try: the answer, recorded in ``outcome``; None (and the error recorded) when none came."""
    try:
        response = await client.post(line.url, json=line.body)
    except httpx.TransportError as error:
        outcome.status_code = outcome.body = outcome.request_id = None
        outcome.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return None
    outcome.status_code, outcome.error = response.status_code, None
    outcome.request_id = response.headers.get("x-request-id")
    try:
        outcome.body = response.json()
    except ValueError:
        outcome.body = response.text
    return response


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(float(response.headers["retry-after"]), 0.0)
    except (KeyError, ValueError):
        return None
