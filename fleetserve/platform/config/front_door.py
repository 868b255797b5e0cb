"""The front door: where the endpoint listens, request limits, API keys and tenants."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleetserve.platform.config.base import MiB, Strict


_SHA256_HEX = r"^[0-9a-f]{64}$"


class CorsConfig(Strict):
    """Cross-origin requests from browser code (what `vllm serve`'s --allowed-origins and friends set)."""

    # Origins allowed to call the endpoint, e.g. ["https://chat.example.com"]; ["*"]: any.
    allowed_origins: list[str] = Field(min_length=1)
    allowed_methods: list[str] = Field(default_factory=lambda: ["GET", "POST", "OPTIONS"])
    # Request headers browser code may send (Authorization for API keys, Content-Type for JSON bodies).
    allowed_headers: list[str] = Field(default_factory=lambda: ["Authorization", "Content-Type", "x-api-key"])
    # Whether browsers may send cookies; the API's keys are bearer tokens, so it needs none.
    allow_credentials: bool = False
    # Response headers browser code may read beyond the CORS-safelisted ones and the platform's own (routing,
    # rate limits, the request id), which are always exposed.
    expose_headers: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _no_credentials_for_any_origin(self) -> CorsConfig:
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials with allowed_origins ['*'] would let any site call the endpoint "
                             "with a visitor's cookies; name the origins")
        return self


class ServerConfig(Strict):
    """Where the OpenAI-compatible endpoint listens."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, gt=0, lt=65536)
    # Ray custom resources the ingress and metrics-hub replicas ask for, to keep them off the nodes whose
    # loss should cost only engines, e.g. {"node:__internal_head__": 0.001} (Ray's own resource of the head
    # node); empty: Ray places them on any node.
    custom_resources: dict[str, float] = Field(default_factory=dict)
    # Where Serve runs its HTTP proxies (Serve's proxy_location): EveryNode (Serve's default) spreads
    # connections over every node's proxy, and a node's loss drops the connections its proxy held; HeadOnly
    # keeps them all on the head, beside an ingress kept there by custom_resources.
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    # Ray Serve's faster path: calls between replicas, and the front door's, over gRPC instead of Ray actor
    # calls (one of its throughput-optimized mode's options), with HAProxy as the HTTP front door instead of
    # Serve's Python proxy: 0.79-0.81x bare vLLM's output tokens/s, against 0.71-0.73x for gRPC alone and
    # 0.63-0.76x for Serve's defaults (docs/benchmarks.md). Off by default: made the default, the overload
    # test failed on it in 1 of 2 fresh-clone suite runs (one /metrics sample past 10 s at the flood's end),
    # as gRPC alone had in 1 of 3. The replicas' gRPC ports must be reachable between nodes; HAProxy also
    # listens on every interface at 8404 (stats) and 9101 (its metrics).
    serve_fast_path: bool = False
    # Replicas of the ingress deployment. Each enforces an equal part of every tenant's rate limits and of
    # the admission bounds (split exactly, so N replicas never allow N times a budget); Serve's proxy spreads
    # requests over them, so a tenant whose requests land unevenly may be limited a little early. One
    # replica's death ends only its own streams.
    num_ingress_replicas: int = Field(default=1, ge=1)
    # Seconds a stopping ingress or engine replica (scaled down, replaced by a rolling update or `fleetserve
    # apply`, or shut down) keeps serving the requests it holds before Serve kills it; one holding none stops at
    # once. Serve's default, 20 s, cut every generation that outlasted it. The chart's RayService keeps an
    # upgraded-away cluster this long too (plus 30 s).
    drain_timeout_s: float = Field(default=300.0, gt=0)
    # Cross-origin requests from browser code; None answers none (unlike `vllm serve`, which allows every
    # origin unless told otherwise).
    cors: CorsConfig | None = None


class LimitsConfig(Strict):
    """Request limits and overload protection, enforced by the ingress before any engine work."""

    # Largest request body in bytes (by Content-Length, and counted as it streams); larger ones get a 400.
    max_body_bytes: int = Field(default=4 * MiB, gt=0)
    # Requests one ingress replica holds at once (each waits on an engine or streams from one, or is on its
    # way to a refusal). Each costs the replica ~100 KiB while held (a Ray fiber stack, gRPC call state), and
    # an ingress starved of CPU fills every slot: this bounds its memory (docs/benchmarks.md).
    ingress_max_ongoing_requests: int = Field(default=4096, gt=0)
    # Requests Serve's proxy may queue for the ingress once every ingress replica holds its most; beyond it,
    # the proxy answers 503 with Retry-After (Serve's plain-text body) instead of queueing without bound.
    ingress_max_queued_requests: int = Field(default=1024, gt=0)
    # The Retry-After those 503s carry, in seconds.
    ingress_retry_after_s: int = Field(default=1, ge=0)
    # Most messages in one chat request.
    max_messages: int = Field(default=512, gt=0)
    # Largest max_tokens a request may ask for; None leaves it to each model's context length.
    max_tokens: int | None = Field(default=None, gt=0)
    # Longest prompt in characters (a chat's message contents together), checked before tokenizing.
    max_prompt_chars: int = Field(default=1_000_000, gt=0)
    # Requests admitted per replica of a model (running, queued in the engine or in front of it); beyond
    # it, new requests get 503 with Retry-After at once instead of queueing without bound. None: unbounded.
    max_in_flight_per_replica: int | None = Field(default=1024, gt=0)
    # Queue bound: admit a request only while the model's queued requests (waiting in engines or on their
    # way) would drain within this many seconds at the rate its engines finish requests; beyond it, 503
    # with a Retry-After. None: only max_in_flight_per_replica bounds admission.
    max_queue_wait_s: float | None = Field(default=60.0, gt=0)
    # Queue fill (share of the queue bound) beyond which a tenant past its weighted share of the queue is
    # refused (503), so one tenant's flood cannot take the whole queue; below it any tenant may queue.
    fair_share_from: float = Field(default=0.5, ge=0, le=1)
    # Engine slots of each model (max_num_seqs x serving replicas) kept for interactive requests on the fair
    # schedule (start tag not past the virtual time): a flood's or batch request waits in the ingress rather
    # than take them, so a light tenant's request starts at once beside a flood (vLLM does not preempt a
    # running request for a waiting one). Reserved slots idle while no such request uses them. Counted per
    # ingress replica; applies with auth on (tenants). 0: none held.
    num_reserved_slots: int = Field(default=0, ge=0)
    # Queue allowed per serving replica however slowly the engines finish (and before they have finished any).
    min_queued_per_replica: int = Field(default=128, gt=0)
    # Times a request is sent again when its replica fails (dies, restarts) before streaming anything;
    # a request that has streamed output ends with an error event instead, since output cannot be unsent.
    max_unstarted_retries: int = Field(default=2, ge=0)
    # Seconds a request may go without a new token (the first included) before it is aborted in the engine
    # and reported to the client; None: no limit. Non-streamed requests' tokens are reported every 2 s.
    progress_timeout_s: float | None = Field(default=300.0, gt=0)


class TenantConfig(Strict):
    """One team or application sharing the platform."""

    # Served model names and routed names this tenant may call; ["*"] allows all of them.
    models: list[str] = Field(default_factory=lambda: ["*"])
    # Requests per minute (token bucket, bursts up to a minute's worth); None: unlimited.
    requests_per_minute: float | None = Field(default=None, gt=0)
    # Tokens per minute, charged at admission as the prompt's estimated tokens plus max_tokens; None: unlimited.
    tokens_per_minute: float | None = Field(default=None, gt=0)
    # Share of each model's admission queue under overload: this weight over the sum of all tenants' weights.
    weight: float = Field(default=1.0, gt=0)
    # interactive: may queue up to the whole admission bound. batch: only up to limits.fair_share_from of it,
    # so interactive work always finds room; on engines with vLLM's priority scheduling
    # (engine_args.extra.scheduling_policy: priority) its requests are also scheduled after interactive ones.
    priority: Literal["interactive", "batch"] = "interactive"
    # Record this tenant's routed prompts (and accept its feedback) in model_routing.recording.
    record_routed_prompts: bool = False


class APIKeyConfig(Strict):
    """One API key, stored only as its hash."""

    # sha256 of the key, hex (``fleetserve auth hash-key`` prints it); the key itself is never stored.
    sha256: str = Field(pattern=_SHA256_HEX)
    # The tenant this key belongs to (a key of auth.tenants).
    tenant: str
    # Admin keys may also read platform state beyond health (/metrics) and load or unload LoRA adapters.
    admin: bool = False


class AuthConfig(Strict):
    """API keys and tenants for the OpenAI endpoint (``Authorization: Bearer <key>``)."""

    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    api_keys: list[APIKeyConfig] = Field(default_factory=list)
    # A mounted secret file with more keys: a YAML list of {sha256, tenant, admin}, read at start.
    api_keys_file: str | None = None

    @model_validator(mode="after")
    def _keys_name_tenants(self) -> AuthConfig:
        if not self.api_keys and self.api_keys_file is None:
            raise ValueError("auth needs api_keys or api_keys_file; to serve without keys, leave auth out")
        unknown = sorted({key.tenant for key in self.api_keys} - set(self.tenants))
        if unknown:
            raise ValueError(f"api_keys name tenants {unknown} that auth.tenants does not define")
        return self
