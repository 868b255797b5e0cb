"""Runs a benchmark: sends a workload on an arrival schedule and collects per-request records."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from fleetserve.loadtest.arrivals import inter_arrival_times
from fleetserve.loadtest.client import API_PATHS, Api, RequestRecord, build_payload, send_request
from fleetserve.loadtest.connections import ConnectionPools
from fleetserve.loadtest.datasets import RequestSpec
from fleetserve.loadtest.metrics import compute_metrics, timeline
from fleetserve.loadtest.pacing import Pacer


class BenchError(RuntimeError):
    """The benchmark cannot run (unreachable server, unknown model); the message says why."""


@dataclass
class BenchConfig:
    """How to load the endpoint. Stored with every result so a run can be reproduced."""

    base_url: str
    # The model name to request, or several, comma-separated: each request then asks for one of them.
    model: str
    api: Api = "completions"
    # Requests per second; math.inf sends everything at once.
    request_rate: float = math.inf
    # Gamma shape of inter-arrival times: 1.0 is Poisson, lower is burstier.
    burstiness: float = 1.0
    # Most requests in flight at once; None: no limit.
    max_concurrency: int | None = None
    num_warmups: int = 0
    # Stop sending new requests after this long; in-flight requests still finish.
    max_seconds: float | None = None
    seed: int = 0
    ignore_eos: bool = False
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    # SLOs in ms for request goodput, e.g. {"ttft": 500}.
    goodput: dict[str, float] = field(default_factory=dict)
    # Per-request timeout.
    timeout_s: float = 600.0
    # Describes the workload (dataset name and parameters), for the record.
    dataset: dict[str, Any] = field(default_factory=dict)
    # With several models: the Zipf exponent of their popularity, in the order given (0: uniform). Many
    # fine-tunes of a base see a few hot adapters and a long tail.
    model_zipf: float = 0.0
    # Sent as `Authorization: Bearer <key>`; never saved with the results.
    api_key: str | None = field(default=None, repr=False)

    @property
    def schedule(self) -> str:
        """How requests are sent, for titles: a rate, or a recorded trace's replay speed."""
        if self.dataset.get("dataset_name") == "trace":
            return f"trace replay x{self.dataset.get('rate_scale', 1.0):g}"
        return f"{'inf' if math.isinf(self.request_rate) else f'{self.request_rate:g}'} req/s"

    @property
    def model_names(self) -> list[str]:
        return [name.strip() for name in self.model.split(",") if name.strip()]

    @property
    def v1_url(self) -> str:
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else f"{base}/v1"

    @property
    def endpoint(self) -> str:
        return f"{self.v1_url}/{API_PATHS[self.api]}"


@dataclass
class RunResult:
    """One benchmark run: its config, figures, and (optionally kept) per-request records."""

    config: BenchConfig
    metrics: dict[str, Any]
    records: list[RequestRecord]
    # True when Ctrl-C stopped the run early; figures cover the requests that finished.
    interrupted: bool = False
    started_at: float = 0.0

    def to_dict(self, detailed: bool) -> dict[str, Any]:
        config = asdict(self.config)
        del config["api_key"]
        config["request_rate"] = "inf" if math.isinf(self.config.request_rate) else self.config.request_rate
        data: dict[str, Any] = {
            "config": config, "metrics": self.metrics, "interrupted": self.interrupted,
            "started_at": self.started_at, "num_requests_sent": len(self.records),
            "errors": dict(Counter(record.error.split("\n")[0][:200] for record in self.records if record.error)),
            "routing": routing_counts(self.records),
            "timeline": timeline(self.records),
        }
        if detailed:
            data["records"] = [record.to_dict() for record in self.records]
        return data


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def routing_counts(records: list[RequestRecord]) -> dict[str, dict[str, int]]:
    """How often each value of each recorded routing header came back (which replica, pool, reason).

    Headers that carry a number per request (a route's win rate) are measurements, not choices: left out.
    """
    names = sorted({name for record in records for name in record.routing})
    counts = {name: Counter(record.routing[name] for record in records if name in record.routing) for name in names}
    return {name: dict(count) for name, count in counts.items() if not all(_is_number(value) for value in count)}


async def preflight(config: BenchConfig, http: httpx.AsyncClient) -> None:
    """Fails fast, with a clear message, when the server is unreachable or lacks the model."""
    url = f"{config.v1_url}/models"
    try:
        response = await http.get(url, timeout=5.0)
    except httpx.HTTPError as error:
        raise BenchError(f"cannot reach {url}: {type(error).__name__}: {error or 'no response'}") from None
    if response.status_code != 200:
        return  # some servers have no /models; the requests themselves will tell
    served = [item.get("id") for item in response.json().get("data", [])]
    missing = [name for name in config.model_names if served and name not in served]
    if missing:
        raise BenchError(f"model {', '.join(map(repr, missing))} is not served at {config.v1_url}; "
                         f"it serves: {', '.join(served)}")


def request_models(config: BenchConfig, num_requests: int) -> list[str]:
    """The model each request asks for: the one name, or a seeded draw over several by Zipf popularity."""
    names = config.model_names
    if len(names) == 1:
        return names * num_requests
    weights = 1.0 / np.arange(1, len(names) + 1) ** config.model_zipf
    rng = np.random.default_rng(config.seed)
    return [names[i] for i in rng.choice(len(names), size=num_requests, p=weights / weights.sum())]


async def run_benchmark(config: BenchConfig, specs: Sequence[RequestSpec], stop: asyncio.Event | None = None,
                        on_done: Callable[[RequestRecord], None] | None = None,
                        count_tokens: Callable[[str], int] | None = None) -> RunResult:
    """Sends ``specs`` on the configured schedule; returns when all finish or ``stop`` is set.

    Token counts come from the server's usage; for servers that send none, ``count_tokens`` (the
    model's tokenizer) counts the output text, or else each content chunk counts as one token.

    Raises:
        BenchError: the server is unreachable or does not serve the model.
    """
    stop = stop or asyncio.Event()
    # max_concurrency is the slots' bound (below), so no pool needs one of its own.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with ConnectionPools(timeout=httpx.Timeout(config.timeout_s, connect=10.0), limits=limits,
                               headers=headers) as pools:
        await preflight(config, pools.first)
        for spec, model in zip(specs[:config.num_warmups], request_models(config, len(specs))):
            payload = build_payload(spec, config.api, model, config.ignore_eos)
            await send_request(pools.first, config.endpoint, payload, config.api, time.perf_counter())
        return await _dispatch(config, specs, pools, stop, on_done, count_tokens)


def _fill_counts(record: RequestRecord, spec: RequestSpec, count_tokens: Callable[[str], int] | None) -> None:
    if not record.ok or record.usage_from_server:
        return
    record.prompt_tokens = spec.prompt_len
    record.output_tokens = count_tokens(record.output_text) if count_tokens else len(record.chunk_times)


async def _dispatch(config: BenchConfig, specs: Sequence[RequestSpec], pools: ConnectionPools,
                    stop: asyncio.Event, on_done: Callable[[RequestRecord], None] | None,
                    count_tokens: Callable[[str], int] | None) -> RunResult:
    delays = inter_arrival_times(len(specs), config.request_rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    records: list[RequestRecord] = []
    started_at = time.time()
    pacer = Pacer(stop)
    run_start = pacer.start
    max_seconds = config.max_seconds or math.inf

    async def one(spec: RequestSpec, model: str) -> None:
        payload = build_payload(spec, config.api, model, config.ignore_eos)
        if slots is None:
            record = await send_request(pools.next(), config.endpoint, payload, config.api, run_start, spec)
        else:
            async with slots:
                record = await send_request(pools.next(), config.endpoint, payload, config.api, run_start, spec)
        _fill_counts(record, spec, count_tokens)
        records.append(record)
        if on_done:
            on_done(record)

    tasks: list[asyncio.Task] = []
    # A recorded trace brings its own send times.
    offsets = ([spec.send_at_s for spec in specs] if specs and all(spec.send_at_s is not None for spec in specs)
               else np.cumsum(delays))
    models = request_models(config, len(specs))
    for spec, model, offset in zip(specs, models, np.asarray(offsets, dtype=float), strict=True):
        if not await pacer.wait_until(float(offset)) or pacer.elapsed() >= max_seconds:
            break
        tasks.append(asyncio.create_task(one(spec, model)))
    pending = set(tasks)
    while pending and not stop.is_set():
        _, pending = await asyncio.wait(pending, timeout=0.2)
    for task in pending:  # interrupted: drop what is still in flight
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    finished = max((record.start + (record.e2el or 0.0) for record in records), default=0.0)
    duration = finished if records else pacer.elapsed()
    metrics = compute_metrics(records, duration, config.percentiles, config.goodput or None)
    return RunResult(config, metrics, sorted(records, key=lambda record: record.start),
                     interrupted=stop.is_set(), started_at=started_at)
