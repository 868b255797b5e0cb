"""``fleetserve status``: per-replica state read from a running platform's ``/metrics``."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

# Leading hex digits of a Ray node id shown in the table (as `ray status` and Ray's dashboard shorten them).
NODE_ID_CHARS = 8
# Series keyed by (model, pool, replica).
ReplicaKey = tuple[str, str, str]


@dataclass
class Scrape:
    """The engine series of one scrape, per replica, and when it was taken."""

    taken_at: float
    gauges: dict[ReplicaKey, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    counters: dict[ReplicaKey, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    # The Ray node id each replica runs on (from fleetserve_replica_node_info).
    nodes: dict[ReplicaKey, str] = field(default_factory=dict)
    # Replicas per served (model, pool), as the ingress counts them: 0 for a pool at zero.
    pool_replicas: dict[tuple[str, str], int] = field(default_factory=dict)
    # Requests held at the ingress while a model's pool wakes from zero.
    held: dict[str, int] = field(default_factory=dict)


_GAUGES = {"vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"}
_NODE_INFO = "fleetserve_replica_node_info"
_POOL_REPLICAS = "fleetserve_replicas"
_HELD = "fleetserve_held_requests"
_COUNTERS = {"vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
             "vllm:prefix_cache_queries_total", "vllm:request_success_total",
             "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"}


def parse_metrics(text: str, taken_at: float) -> Scrape:
    scrape = Scrape(taken_at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("model_name", "?"), labels.get("pool", "?"), labels.get("replica", "?"))
            if sample.name == _NODE_INFO:
                scrape.nodes[key] = labels.get("node_id", "?")
            if sample.name == _POOL_REPLICAS:
                scrape.pool_replicas[(labels.get("model", "?"), labels.get("pool", "?"))] = int(sample.value)
            if sample.name == _HELD:
                scrape.held[labels.get("model", "?")] = int(sample.value)
            if sample.name not in _GAUGES and sample.name not in _COUNTERS:
                continue
            target = scrape.gauges if sample.name in _GAUGES else scrape.counters
            target[key][sample.name] = target[key].get(sample.name, 0.0) + sample.value
    return scrape


def fetch(url: str, client: httpx.Client, now: float) -> Scrape:
    """Scrapes ``{url}/metrics``.

    Raises:
        httpx.HTTPError: the platform is unreachable or answered with an error.
    """
    response = client.get(f"{url.rstrip('/')}/metrics", timeout=5)
    response.raise_for_status()
    return parse_metrics(response.text, now)


def status_table(before: Scrape, after: Scrape, url: str) -> Table:
    """Models, replicas, KV usage, queues and token rates between two scrapes."""
    elapsed = max(after.taken_at - before.taken_at, 1e-9)
    table = Table(title=f"fleetserve status: {url}")
    for column in ("model", "pool", "replica", "node", "KV usage", "running", "waiting", "gen tok/s", "prompt tok/s",
                   "prefix hit", "draft accepted", "requests"):
        table.add_column(column, justify="left" if column in ("model", "pool", "replica", "node") else "right")
    keys = sorted(set(after.gauges) | set(after.counters))
    replicas_per_model: dict[str, int] = defaultdict(int)
    for key in keys:
        gauges, now, then = after.gauges.get(key, {}), after.counters.get(key, {}), before.counters.get(key, {})

        def rate(name: str) -> float:
            return max(0.0, now.get(name, 0.0) - then.get(name, 0.0)) / elapsed

        queries = now.get("vllm:prefix_cache_queries_total", 0.0)
        hit = f"{now.get('vllm:prefix_cache_hits_total', 0.0) / queries:.0%}" if queries else "-"
        drafted = now.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
        accepted = f"{now.get('vllm:spec_decode_num_accepted_tokens_total', 0.0) / drafted:.0%}" if drafted else "-"
        replicas_per_model[key[0]] += 1
        table.add_row(key[0], key[1], key[2], after.nodes.get(key, "-")[:NODE_ID_CHARS], f"{gauges.get('vllm:kv_cache_usage_perc', 0.0):.1%}",
                      f"{gauges.get('vllm:num_requests_running', 0.0):.0f}",
                      f"{gauges.get('vllm:num_requests_waiting', 0.0):.0f}",
                      f"{rate('vllm:generation_tokens_total'):.1f}", f"{rate('vllm:prompt_tokens_total'):.1f}",
                      hit, accepted, f"{now.get('vllm:request_success_total', 0.0):.0f}")
    table.caption = _caption(replicas_per_model, after)
    return table


def _caption(replicas_per_model: dict[str, int], scrape: Scrape) -> str:
    """Each model's replica count, then the models at zero with the requests held for them."""
    parts = [f"{model}: {count} replica{'s' if count > 1 else ''}"
             for model, count in sorted(replicas_per_model.items())]
    at_zero = {model for (model, _), count in scrape.pool_replicas.items() if count == 0} - set(replicas_per_model)
    parts += [f"{model}: at zero" + (f", {scrape.held[model]} held" if scrape.held.get(model) else "")
              for model in sorted(at_zero)]
    return "  ".join(parts) if parts else "no engine replicas are reporting yet"
