"""What fleetserve adds to the OpenAI protocol: its response headers and the ingress's own error bodies.

Requests and responses themselves are vLLM's: the engine replicas run vLLM's OpenAI app.
"""

from __future__ import annotations

import uuid
from typing import Any

# Response headers that say who served a request; `fleetserve bench` records them per request.
HEADER_MODEL = "x-fleetserve-model"
HEADER_REPLICA = "x-fleetserve-replica"
HEADER_POOL = "x-fleetserve-pool"
# Disaggregated models: the prefill replica whose KV the decode replica (x-fleetserve-replica) continued;
# absent when the prompt was short enough to prefill on the decode replica (min_prompt_tokens).
HEADER_PREFILL_REPLICA = "x-fleetserve-prefill-replica"
# Why the replica router chose that replica: cache_hit, load, imbalance, session, round_robin, power_of_two.
HEADER_ROUTE_REASON = "x-fleetserve-route-reason"
# The routed name a cost/quality route resolved (e.g. "auto"), and the strong win rate it computed.
HEADER_ROUTE = "x-fleetserve-route"
HEADER_WIN_RATE = "x-fleetserve-win-rate"
# Why the route picked that model (RouteReason: below_threshold, strongest_needed, threshold_zero,
# out_of_domain), and the prompt's distance from the router's training prompts when measured. Not
# x-fleetserve-route-reason, which already says why the replica router picked the replica.
HEADER_MODEL_ROUTE_REASON = "x-fleetserve-model-route-reason"
HEADER_DOMAIN_DISTANCE = "x-fleetserve-domain-distance"
# Clients may name a session for session-affinity routing (the body's `user` field works too).
HEADER_SESSION = "x-session-id"
HEADER_REQUEST_ID = "x-request-id"
ROUTING_HEADERS = (HEADER_MODEL, HEADER_REPLICA, HEADER_POOL, HEADER_PREFILL_REPLICA, HEADER_ROUTE_REASON)
# OpenAI's rate-limit headers, x-ratelimit-{limit,remaining,reset}-<kind>, one set per budget a tenant may have.
RATE_LIMIT_KINDS = ("requests", "tokens")
RATE_LIMIT_HEADERS = tuple(f"x-ratelimit-{field}-{kind}" for kind in RATE_LIMIT_KINDS
                           for field in ("limit", "remaining", "reset"))
# What browser code may read on a cross-origin response (server.cors): routing, rate limits, the request id.
CORS_EXPOSED_HEADERS = (HEADER_REQUEST_ID, *ROUTING_HEADERS, HEADER_ROUTE, HEADER_MODEL_ROUTE_REASON, HEADER_WIN_RATE,
                        HEADER_DOMAIN_DISTANCE, "retry-after", *RATE_LIMIT_HEADERS)


class APIError(Exception):
    """An error the API returns as OpenAI's error JSON."""

    def __init__(self, message: str, status_code: int = 400, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.param = param
        self.code = code
        # Extra response headers, e.g. Retry-After on 429 and 503.
        self.headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
