"""The ingress's own ``fleetserve_*`` metrics: what the platform adds in front of the engines.

The engines' series (vLLM's names) come from ``fleetserve.platform.metrics``; ``/metrics`` serves both.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class IngressMetrics:
    """The ingress's own ``fleetserve_*`` metrics: what the platform adds in front of the engines."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("fleetserve_requests", "API requests by route, model and HTTP status.",
                                ["route", "model", "status"], registry=self.registry)
        self.queue_time = Histogram("fleetserve_ingress_queue_seconds",
                                    "Time from the request reaching the ingress to an engine starting on it.",
                                    ["model"], registry=self.registry,
                                    buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30])
        self.routing_decisions = Counter("fleetserve_routing_decisions", "Replica-routing decisions by reason.",
                                         ["model", "reason"], registry=self.registry)
        self.cost = Counter("fleetserve_estimated_cost_dollars",
                            "Estimated cost of served tokens at the model's configured prices.", ["model"],
                            registry=self.registry)
        self.tenant_tokens = Counter("fleetserve_tenant_tokens", "Tokens served per tenant (auth on), model and "
                                     "kind (prompt or completion), from the engines' usage.",
                                     ["tenant", "model", "kind"], registry=self.registry)
        self.tenant_cost = Counter("fleetserve_tenant_estimated_cost_dollars", "Estimated cost of a tenant's "
                                   "served tokens at the model's configured prices.", ["tenant", "model"],
                                   registry=self.registry)
        self.model_route_decisions = Counter("fleetserve_model_route_decisions",
                                             "Cost/quality routing decisions by routed name, chosen model and "
                                             "reason.", ["route", "model", "reason"], registry=self.registry)
        self.route_strong_share = Gauge("fleetserve_route_strong_share", "Share of the route's requests this "
                                        "ingress sent to its strongest tier since it started.", ["route"],
                                        registry=self.registry)
        self.route_strong_share_target = Gauge("fleetserve_route_strong_share_target", "The route's configured "
                                               "strong_fraction.", ["route"], registry=self.registry)
        self.route_cost_saved = Counter("fleetserve_route_cost_saved_dollars",
                                        "Estimated dollars saved by routed requests against always using the "
                                        "route's strongest tier.", ["route"], registry=self.registry)
        self.replicas = Gauge("fleetserve_replicas", "Engine replicas currently reporting, per deployment.",
                              ["model", "pool"], registry=self.registry)
        self.in_flight = Gauge("fleetserve_in_flight_requests", "Requests this ingress has admitted and not "
                               "finished, per model.", ["model"], registry=self.registry)
        self.admission_queue = Gauge("fleetserve_admission_queue_allowance",
                                     "Requests the admission bound lets queue for the model now.", ["model"],
                                     registry=self.registry)
        self.rejections = Counter("fleetserve_admission_rejections", "Requests refused with 503 at admission, "
                                  "by which bound refused them (queue, share, batch, in_flight, cold_start_full or "
                                  "cold_start_timeout).", ["model", "bound"],
                                  registry=self.registry)
        self.held = Gauge("fleetserve_held_requests", "Requests held while the model's pool wakes from zero "
                          "replicas.", ["model"], registry=self.registry)
        self.slot_held = Gauge("fleetserve_slot_held_requests", "Requests held in the ingress because they would "
                               "take an engine slot reserved for tenants within their share "
                               "(limits.num_reserved_slots).", ["model"], registry=self.registry)
        self.cold_start = Histogram("fleetserve_cold_start_seconds", "From the first request held for a pool at "
                                    "zero replicas to its first token.", ["model"], registry=self.registry,
                                    buckets=[1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600])
        self.engine_retries = Counter("fleetserve_engine_retries", "Requests sent again because their replica "
                                      "failed before streaming anything.", ["model"], registry=self.registry)
        self.scrapes_without_engines = Counter("fleetserve_scrapes_without_engines", "Scrapes of /metrics answered "
                                               "without the engines' metrics: the metrics hub did not answer in time.",
                                               registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
