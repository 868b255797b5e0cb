"""The contract between the ingress and an engine replica: an OpenAI request forwarded as bytes, and the
replica's response relayed as bytes.

The replica runs vLLM's own OpenAI app, so the body is never turned into fleetserve objects on the way:
the ingress reads only the few fields it needs (model, limits, routing text) and forwards the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any


class Endpoint(str, Enum):
    """The API paths the ingress forwards to engine replicas, each served there by vLLM."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"
    # Anthropic's messages.count_tokens.
    COUNT_TOKENS = "/v1/messages/count_tokens"
    EMBEDDINGS = "/v1/embeddings"
    POOLING = "/pooling"
    # vLLM's scoring of text pairs: cosine similarity on embedding models, a cross-encoder's score on
    # one-label classifiers.
    SCORE = "/score"
    # Jina's and Cohere's rerank API over the same scoring.
    RERANK = "/rerank"
    CLASSIFY = "/classify"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"

    @classmethod
    def of_path(cls, path: str) -> Endpoint | None:
        """The endpoint a request path ends with, under any route prefix (an alias in ``ENDPOINT_ALIASES``
        ends with its endpoint's path); None for other paths."""
        return next((endpoint for endpoint in cls if path.endswith(endpoint.value)), None)

    @property
    def is_anthropic(self) -> bool:
        """Whether the path is Anthropic's API, whose errors take Anthropic's shape."""
        return self in (Endpoint.MESSAGES, Endpoint.COUNT_TOKENS)

    @property
    def generates(self) -> bool:
        """Whether requests on this path run the engine's sampler (and count against admission)."""
        return self in GENERATING_ENDPOINTS


GENERATING_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES})
# Other paths vLLM serves the same request on: its older /v1/score and /v1/rerank (Ray Serve LLM's and Jina's
# clients) and Cohere's /v2/rerank. The ingress forwards them to the endpoint's own path.
ENDPOINT_ALIASES: dict[str, Endpoint] = {"/v1/score": Endpoint.SCORE, "/v1/rerank": Endpoint.RERANK,
                                         "/v2/rerank": Endpoint.RERANK}


@dataclass(frozen=True)
class RoutingHints:
    """What the replica router reads about a request, in the caller's process; never sent to a replica."""

    # The text prefix-aware routing matches on: the prompt, or the messages' roles and contents in order.
    prefix_text: str = ""
    # Keeps a conversation on one replica under session routing (the API's `user` or x-session-id).
    session_id: str | None = None
    # prefix_source kv_events: the chat messages, tokenized by the router as the engine does.
    messages: list[dict[str, Any]] | None = None
    # prefix_source kv_events: the completion prompt, text or token ids.
    prompt: str | list[int] | None = None
    # The LoRA adapter the request asks for (its model name); None for the base model.
    adapter: str | None = None
    # Replicas whose engine died under this request before it streamed anything: its retry goes elsewhere.
    avoid_replica_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ApiRequest:
    """One OpenAI API call, forwarded to an engine replica with its body unchanged."""

    # fleetserve's id for the call; vLLM derives its response id and engine request id from it.
    request_id: str
    # The API path the replica's vLLM app serves it on.
    endpoint: Endpoint
    # The JSON body as the client sent it (only a routed model name is replaced).
    body: bytes
    # The ingress asked for a stream's usage (for cost accounting) where the client did not: the replica
    # reads the usage event and drops it, so the client gets the stream it asked for.
    strip_usage: bool = False
    # vLLM's scheduling priority (lower runs first), set by the platform on priority-scheduled engines and
    # sent as vLLM's priority header, which every generating path reads (Anthropic's request has no such field).
    priority: int | None = None
    # Read by the replica router before the call is sent; dropped when the request is pickled.
    routing: RoutingHints = field(default_factory=RoutingHints)

    def __reduce__(self):
        return (ApiRequest, (self.request_id, self.endpoint, self.body, self.strip_usage, self.priority))

    def avoiding(self, replica_id: str) -> ApiRequest:
        """This request, to be routed to any replica but ``replica_id`` while another can take it."""
        hints = replace(self.routing, avoid_replica_ids=self.routing.avoid_replica_ids | {replica_id})
        return replace(self, routing=hints)


@dataclass(frozen=True)
class ResponseHead:
    """The status and headers of a replica's response, and who produced it."""

    # The HTTP status vLLM answered with (its errors keep their status and JSON body).
    status_code: int
    # vLLM's content type: application/json, or text/event-stream for streams.
    media_type: str
    # The replica that ran the request (the decode replica, for disaggregated models).
    replica_id: str
    # Wall-clock time the replica started on the request (the ingress derives its queue time).
    started_at: float
    # Disaggregated serving: the prefill replica whose KV the decode replica continued.
    prefill_replica_id: str | None = None

    @property
    def is_stream(self) -> bool:
        return self.media_type.startswith("text/event-stream")


@dataclass(frozen=True)
class TokenUsage:
    """Tokens one request used, read from vLLM's `usage` object."""

    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0


@dataclass(frozen=True)
class ReplicaChunk:
    """One piece of a replica's response: as many body bytes as were ready, coalesced into one item."""

    # Response body bytes (SSE events for streams), possibly empty.
    data: bytes
    # On the first chunk only.
    head: ResponseHead | None = None
    # On the last chunk, when the response carried usage.
    usage: TokenUsage | None = None
    # Whether this is the replica's last chunk of the response: a stream that ends without one was cut off,
    # however it ended, and is never passed on as a complete response.
    final: bool = False
    # Carries nothing for the client: the engine made progress on a call whose response has not started
    # (a non-streamed one), which restarts the ingress's progress timeout.
    heartbeat: bool = False


def usage_from(payload: dict[str, Any]) -> TokenUsage | None:
    """The usage of an OpenAI, Responses or Anthropic response body (or stream event), if it has one.

    Anthropic's ``input_tokens`` leaves out the prompt tokens read from or written to the cache, which it counts
    apart; OpenAI's ``prompt_tokens`` and the Responses ``input_tokens`` count them. The prompt is all of them.
    """
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    if usage.get("prompt_tokens") is not None:
        prompt = usage["prompt_tokens"]
    else:
        prompt = sum(usage.get(key) or 0 for key in ("input_tokens", "cache_read_input_tokens",
                                                      "cache_creation_input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return TokenUsage(int(prompt), int(completion))
