"""Prometheus metrics for one engine, under vLLM's own names and meanings.

Existing vLLM dashboards and KEDA examples then work unchanged. Each engine keeps its own registry
(so the exposition holds only its series) and labels every series with ``model_name``, ``replica``
and ``pool``; the serving layer publishes the exposition and the ingress serves the union.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.parser import text_string_to_metric_families

# *_created series double the exposition and no vLLM dashboard reads them.
disable_created_metrics()

LABELS = ("model_name", "replica", "pool")


class StartupPhase(str, enum.Enum):
    """What an engine replica does between its constructor and serving, timed one after another."""

    # The model's HF folder found on local disk, or built there once (a GGUF converted, then cached).
    MODEL_FILES = "model_files"
    # vLLM's AsyncLLM built: its engine-core and worker processes started, weights loaded, KV cache allocated.
    ENGINE = "engine"
    # vLLM's OpenAI serving objects built over the engine (and the adapter set synced).
    APP = "app"


# vLLM's default bucket bounds (vllm/v1/metrics/buckets.py), used when vLLM is not importable.
_FALLBACK_BUCKETS = {
    "time_to_first_token": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "inter_token_latency": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0],
    "request_latency": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0],
}


def _buckets(family: str) -> list[float]:
    try:
        from vllm.v1.metrics.buckets import histogram_buckets

        return histogram_buckets(family)
    except (ImportError, ValueError, TypeError):
        return _FALLBACK_BUCKETS[family]


class EngineMetrics:
    """vLLM-named metrics of one engine replica, fed from the engine's stat logger."""

    def __init__(self, model_name: str, replica: str, pool: str = "colocated", max_loras: int | None = None,
                 clock: Any = time.monotonic, num_speculative_tokens: int | None = None) -> None:
        """Args: ``max_loras``, the engine's LoRA slots; None (no LoRA) leaves out vllm:lora_requests_info;
        ``clock``, monotonic seconds for timing start-up phases; ``num_speculative_tokens``, the draft length of
        speculative decoding, whose series start at zero with it (None: they appear with the first draft, if any).
        """
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        values = (model_name, replica, pool)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, LABELS, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=self.registry).labels(*values)

        def histogram(name: str, doc: str, family: str) -> Any:
            return Histogram(name, doc, LABELS, buckets=_buckets(family), registry=self.registry).labels(*values)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                        [*LABELS, "finished_reason"], registry=self.registry)
        self._values = values
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", "time_to_first_token")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", "inter_token_latency")
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", "request_latency")
        if pool == "decode":
            self.local_prefills = counter("fleetserve_local_prefills",
                                          "Prompts a decode replica prefilled itself: its prefill pool had no "
                                          "running replica.")
        self._max_loras = max_loras
        # vLLM's LoRA info gauge: the time of the last step, labelled with the adapters running and waiting.
        # Only the current label set is kept (vLLM keeps every set it has seen, a series per combination).
        self._lora_info = (Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                 [*LABELS, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                 registry=self.registry) if max_loras is not None else None)
        self._lora_labels: tuple[str, ...] | None = None
        self._start_time = gauge("fleetserve_replica_start_time_seconds",
                                 "When the engine replica's constructor began, in Unix seconds.")
        self._startup = Gauge("fleetserve_replica_startup_seconds", "Seconds an engine replica spent in each phase "
                              "of its start.", [*LABELS, "phase"], registry=self.registry)
        self._spec_decode: _SpecDecodeCounters | None = None
        if num_speculative_tokens is not None:
            self._spec_decode = _SpecDecodeCounters(self.registry, values, num_speculative_tokens)

    def set_start_time(self, unix_s: float) -> None:
        """Records when the replica's constructor began (a cold start's request time subtracted from it is
        the actor's start: scheduling, worker process, imports)."""
        self._start_time.set(unix_s)

    @contextmanager
    def startup_phase(self, phase: StartupPhase) -> Iterator[None]:
        """Times the block as one phase of the replica's start (not recorded if the block raises)."""
        began = self._clock()
        yield
        self._startup.labels(*self._values, phase.value).set(self._clock() - began)

    def set_node(self, node_id: str, node_ip: str) -> None:
        """Names the Ray node this replica runs on (``fleetserve_replica_node_info``, always 1)."""
        Gauge("fleetserve_replica_node_info", "The Ray node an engine replica runs on (always 1).",
              [*LABELS, "node_id", "node_ip"], registry=self.registry).labels(*self._values, node_id, node_ip).set(1)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Folds one engine step in; arguments are vLLM's SchedulerStats and IterationStats."""
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.prefix_cache_queries.inc(prefix.queries)
                self.prefix_cache_hits.inc(prefix.hits)
            if self._lora_info is not None:
                self._record_lora(scheduler_stats)
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                if self._spec_decode is None:
                    self._spec_decode = _SpecDecodeCounters(self.registry, self._values, spec.num_spec_tokens)
                self._spec_decode.observe(spec)
        if iteration_stats is None:
            return
        self.num_preemptions.inc(iteration_stats.num_preempted_reqs)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for seconds in iteration_stats.time_to_first_tokens_iter:
            self.time_to_first_token.observe(seconds)
        for seconds in iteration_stats.inter_token_latencies_iter:
            self.inter_token_latency.observe(seconds)
        for finished in iteration_stats.finished_requests:
            reason = str(getattr(finished.finish_reason, "name", finished.finish_reason)).lower()
            self._request_success.labels(*self._values, reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)

    def _record_lora(self, scheduler_stats: Any) -> None:
        labels = (*self._values, str(self._max_loras),
                  ",".join(getattr(scheduler_stats, "waiting_lora_adapters", {}) or {}),
                  ",".join(getattr(scheduler_stats, "running_lora_adapters", {}) or {}))
        if self._lora_labels is not None and labels != self._lora_labels:
            self._lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def exposition(self) -> bytes:
        """This engine's series in Prometheus text format."""
        return generate_latest(self.registry)


class _SpecDecodeCounters:
    """vLLM's speculative decoding counters (vllm/v1/spec_decode/metrics.py): accepted over draft tokens is the
    acceptance rate, and accepted tokens per position show how far into a draft it stays right."""

    def __init__(self, registry: CollectorRegistry, values: tuple[str, ...], num_speculative_tokens: int) -> None:
        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=registry).labels(*values)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                               [*LABELS, "position"], registry=registry)
        self.accepted_per_position = [per_position.labels(*values, str(position))
                                      for position in range(num_speculative_tokens)]

    def observe(self, spec: Any) -> None:
        """Folds in one step's ``SpecDecodingStats``."""
        self.num_drafts.inc(spec.num_drafts)
        self.num_draft_tokens.inc(spec.num_draft_tokens)
        self.num_accepted_tokens.inc(spec.num_accepted_tokens)
        for counter, accepted in zip(self.accepted_per_position, spec.num_accepted_tokens_per_pos):
            counter.inc(accepted)


class _Families:
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def merge_expositions(texts: Iterable[bytes | str]) -> bytes:
    """One valid exposition from several: each family once, with every source's samples.

    Concatenating expositions would repeat ``# TYPE`` lines, which Prometheus rejects.
    """
    families: dict[str, Any] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
