"""Reading a response's token usage: OpenAI's, the Responses API's and Anthropic's, whole or streamed."""

from __future__ import annotations

import json

import pytest

from fleetserve.platform.api_types import TokenUsage, usage_from
from fleetserve.platform.relay import event_usage


def sse(kind: str | None, payload: dict) -> bytes:
    return (f"event: {kind}\n" if kind else "").encode() + b"data: " + json.dumps(payload).encode() + b"\n\n"


@pytest.mark.parametrize(("usage", "expected"), [
    ({"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}, TokenUsage(10, 3)),
    ({"input_tokens": 10, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 8}}, TokenUsage(10, 3)),
    # Anthropic counts cached prompt tokens apart: 2 read fresh + 8 from the cache + 0 written = 10.
    ({"input_tokens": 2, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 0, "output_tokens": 3},
     TokenUsage(10, 3)),
])
def test_usage_counts_every_prompt_token(usage, expected):
    assert usage_from({"usage": usage}) == expected


def test_an_anthropic_stream_gives_its_prompt_at_the_start_and_its_output_at_the_end():
    start = sse("message_start", {"type": "message_start", "message": {
        "id": "m", "content": [], "usage": {"input_tokens": 2, "cache_read_input_tokens": 8, "output_tokens": 0}}})
    delta = sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": "hi"}})
    # Anthropic's own message_delta carries only the output; vLLM's repeats the input too.
    end = sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                "usage": {"output_tokens": 5}})
    usage = event_usage(start)
    assert usage == TokenUsage(10, 0) and event_usage(delta, usage) == usage
    assert event_usage(delta + end + sse("message_stop", {"type": "message_stop"}), usage) == TokenUsage(10, 5)


def test_a_responses_stream_gives_its_usage_when_completed():
    created = sse("response.created", {"type": "response.created", "response": {"id": "r", "usage": None}})
    done = sse("response.completed", {"type": "response.completed", "response": {
        "id": "r", "usage": {"input_tokens": 7, "output_tokens": 4, "total_tokens": 11}}})
    assert event_usage(created) is None
    assert event_usage(created + done) == TokenUsage(7, 4)
