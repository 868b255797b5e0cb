"""What a decode replica sends to the prefill pool, per endpoint, and how it measures a prompt against
``min_prompt_tokens`` (no engine: the bodies and the decisions alone)."""

from __future__ import annotations

import asyncio
import json

import pytest

from fleetserve.deployments.disaggregated.decode_server import DecodeServer, _tokenize_body
from fleetserve.deployments.disaggregated.prefill_server import cached_prompt_tokens, prefill_body
from fleetserve.platform.api_types import ApiRequest, Endpoint

KEEP = {"kv_transfer_params": {"do_remote_decode": True}, "stream": False}


def test_chat_prefill_asks_one_completion_token_once_unstreamed():
    body = json.loads(prefill_body({"model": "m", "messages": [], "max_tokens": 50, "n": 1, "stream": True,
                                    "stream_options": {"include_usage": True}, "min_tokens": 5}, Endpoint.CHAT))
    assert body == {"model": "m", "messages": [], "n": 1, "min_tokens": 0, "max_completion_tokens": 1, **KEEP}


def test_completion_prefill_asks_one_token():
    body = json.loads(prefill_body({"model": "m", "prompt": "p", "max_tokens": 50}, Endpoint.COMPLETIONS))
    assert body == {"model": "m", "prompt": "p", "n": 1, "min_tokens": 0, "max_tokens": 1, **KEEP}


def test_anthropic_prefill_sets_max_tokens_and_no_openai_only_fields():
    body = json.loads(prefill_body({"model": "m", "messages": [], "max_tokens": 50, "stream": True,
                                    "system": "s"}, Endpoint.MESSAGES))
    assert body == {"model": "m", "messages": [], "system": "s", "max_tokens": 1, **KEEP}


def test_responses_prefill_is_neither_stored_nor_backgrounded():
    body = json.loads(prefill_body({"model": "m", "input": "i", "max_output_tokens": 50, "store": True,
                                    "background": True, "stream": True}, Endpoint.RESPONSES))
    assert body == {"model": "m", "input": "i", "max_output_tokens": 1, "store": False, "background": False, **KEEP}


@pytest.mark.parametrize(("usage", "cached"), [
    ({"prompt_tokens_details": {"cached_tokens": 128}}, 128),   # chat and completions
    ({"input_tokens_details": {"cached_tokens": 256}}, 256),    # Responses
    ({"cache_read_input_tokens": 384}, 384),                    # Anthropic messages
    ({"prompt_tokens": 10}, 0),
])
def test_cached_prompt_tokens_read_from_each_endpoints_usage(usage, cached):
    assert cached_prompt_tokens(usage) == cached


def test_tokenize_body_renders_anthropic_messages_as_chat_text_with_the_system_first():
    payload = {"model": "m", "system": [{"type": "text", "text": "Be brief."}], "max_tokens": 5,
               "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]}
    assert _tokenize_body(Endpoint.MESSAGES, payload) == {
        "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}


def test_tokenize_body_renders_responses_input_after_its_instructions():
    assert _tokenize_body(Endpoint.RESPONSES, {"model": "m", "instructions": "Be brief.", "input": "Hi"}) == {
        "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    # Input items: their text parts, joined.
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    assert _tokenize_body(Endpoint.RESPONSES, {"model": "m", "input": items}) == {
        "model": "m", "messages": [{"role": "user", "content": "ab"}]}
    # Token ids count as themselves; an unreadable body counts 0 (it runs locally and gets vLLM's error).
    assert _tokenize_body(Endpoint.RESPONSES, {"model": "m", "input": [1, 2, 3]}) == 3
    assert _tokenize_body(Endpoint.MESSAGES, {"model": "m", "messages": "x"}) == 0


class Probe(DecodeServer):
    """A decode server with no engine: what it would decide, and the prompt lengths it would ask for."""

    def __init__(self, min_prompt_tokens: int, count: int) -> None:
        self.settings = type("Settings", (), {"min_prompt_tokens": min_prompt_tokens})()
        self.count = count

    async def _num_prompt_tokens(self, request, payload):
        return self.count


@pytest.mark.parametrize(("endpoint", "payload", "remote"), [
    (Endpoint.RESPONSES, {"input": "x"}, True),
    (Endpoint.RESPONSES, {"input": "x", "tools": [{"type": "function", "name": "f"}]}, True),
    # Built-in tools may run several turns on one request; a stored response lives on this replica only.
    (Endpoint.RESPONSES, {"input": "x", "tools": [{"type": "web_search"}]}, False),
    (Endpoint.RESPONSES, {"input": "x", "previous_response_id": "resp_1"}, False),
    (Endpoint.RESPONSES, {"input": "x", "conversation": "conv_1"}, False),
    (Endpoint.MESSAGES, {"messages": [{"role": "user", "content": "x"}]}, True),
    (Endpoint.COMPLETIONS, {"prompt": "x", "n": 2}, False),
    (Endpoint.COMPLETIONS, {"prompt": "x", "echo": True}, False),
])
def test_which_requests_are_prefilled_remotely(endpoint, payload, remote):
    request = ApiRequest("r", endpoint, b"")
    assert asyncio.run(Probe(256, 300)._prefills_remotely(request, {"model": "m", **payload})) is remote


@pytest.mark.parametrize("store", [True, False, None])
def test_background_responses_stay_on_the_decode_replica(store):
    # Refused there at once: by vLLM without its response store, by the replica's request check with it.
    request = ApiRequest("r", Endpoint.RESPONSES, b"")
    payload = {"model": "m", "input": "x", "background": True, **({} if store is None else {"store": store})}
    assert asyncio.run(Probe(256, 300)._prefills_remotely(request, payload)) is False


def test_prompts_below_min_prompt_tokens_stay_on_the_decode_replica():
    request = ApiRequest("r", Endpoint.MESSAGES, b"")
    payload = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    # 255 < 256 stays; 256 goes.
    assert asyncio.run(Probe(256, 255)._prefills_remotely(request, payload)) is False
    assert asyncio.run(Probe(256, 256)._prefills_remotely(request, payload)) is True
