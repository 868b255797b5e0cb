"""What the ingress reads from a request: the session key the replica router reads, and the outputs it asks for."""

from __future__ import annotations

import json

import pytest

from fleetserve.deployments.ingress.request_fields import read_fields
from fleetserve.platform.api_types import Endpoint

MESSAGES = [{"role": "user", "content": "hi"}]


def session(header: str | None = None, **fields) -> str | None:
    payload = {"model": "m", "messages": MESSAGES, **fields}
    return read_fields(Endpoint.CHAT, payload).routing_hints(header).session_id


def test_prompt_cache_key_keys_the_session_before_user():
    assert session(prompt_cache_key="prefix-a", user="alice") == "prefix-a"


def test_user_keys_the_session_without_a_cache_key():
    assert session(user="alice") == "alice"


def test_the_session_header_wins():
    assert session("s-1", prompt_cache_key="prefix-a", user="alice") == "s-1"


def test_no_key_gives_no_session():
    assert session(prompt_cache_key="", user=7) is None


def test_anthropic_metadata_user_id_keys_a_messages_session():
    payload = {"model": "m", "max_tokens": 8, "messages": MESSAGES, "metadata": {"user_id": "session-7"}}
    assert read_fields(Endpoint.MESSAGES, payload).routing_hints(None).session_id == "session-7"
    not_text = {**payload, "metadata": {"user_id": 7}}
    assert read_fields(Endpoint.MESSAGES, not_text).routing_hints(None).session_id is None


@pytest.mark.parametrize(("endpoint", "fields", "num_sequences"), [
    (Endpoint.CHAT, {"messages": MESSAGES, "n": 3}, 3),
    (Endpoint.COMPLETIONS, {"prompt": ["a", "b"], "n": 2}, 4),        # 2 prompts x n=2
    (Endpoint.COMPLETIONS, {"prompt": [[1, 2], [3]]}, 2),             # 2 prompts as token ids
    (Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}, 1),                 # one prompt as token ids
    (Endpoint.COMPLETIONS, {"prompt": "a", "n": "3"}, 1),             # vLLM refuses a malformed n
    (Endpoint.CHAT, {"messages": MESSAGES, "n": True}, 1),
    (Endpoint.RESPONSES, {"input": "a", "n": 4}, 1),                  # not a Responses field
])
def test_outputs_asked_for_count_n_and_each_prompt(endpoint, fields, num_sequences):
    assert read_fields(endpoint, {"model": "m", **fields}).num_sequences == num_sequences


@pytest.mark.parametrize(("endpoint", "fields", "text"), [
    # Anthropic: a tool result's text (a string or blocks), a tool call's input as JSON, reasoning; no image.
    (Endpoint.MESSAGES, {"messages": [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "T"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "R1"},
                                     {"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "R2"}]},
                                     {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]},
     'T{"q": 1}R1R2'),
    # OpenAI chat: an assistant's tool call arguments and the tool's answer.
    (Endpoint.CHAT, {"messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"q\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "R"},
        {"role": "user", "content": [{"type": "text", "text": "U"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     '{"q":1}RU'),
    # Responses: a function call's arguments and its output.
    (Endpoint.RESPONSES, {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "A"},
                                    {"type": "function_call_output", "call_id": "c1", "output": "O"},
                                    {"role": "user", "content": [{"type": "input_text", "text": "U"}]}]},
     "AOU"),
    # Score and rerank: every text of the pairs once, in any of vLLM's shapes; an image part is not text.
    (Endpoint.SCORE, {"text_1": "Q", "text_2": ["D1", "D2"]}, "QD1D2"),
    (Endpoint.SCORE, {"queries": ["Q1", "Q2"], "documents": ["D1", "D2"]}, "Q1Q2D1D2"),
    (Endpoint.RERANK, {"query": "Q", "documents": ["D1", {"content": [{"type": "text", "text": "D2"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "QD1D2"),
    # Classify: a completion-style input or chat messages.
    (Endpoint.CLASSIFY, {"input": ["I1", "I2"]}, "I1I2"),
    (Endpoint.CLASSIFY, {"messages": [{"role": "user", "content": "U"}]}, "U"),
])
def test_prompt_text_counts_tool_calls_and_results(endpoint, fields, text):
    # Before, only text parts counted: a tool result of any size passed max_prompt_chars and was charged nothing.
    assert read_fields(endpoint, {"model": "m", **fields}).prompt_text == text


@pytest.mark.parametrize("stream", ["yes", 1, "true"])
def test_a_stream_flag_that_is_not_a_boolean_is_refused(stream):
    from fleetserve.deployments.ingress.protocol import APIError

    with pytest.raises(APIError, match="`stream` must be a boolean") as raised:
        read_fields(Endpoint.CHAT, {"model": "m", "messages": MESSAGES, "stream": stream})
    assert (raised.value.status_code, raised.value.param) == (400, "stream")


def test_tool_definitions_and_instructions_count_toward_the_prompt_but_are_not_routed_on():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    fields = read_fields(Endpoint.RESPONSES, {"model": "m", "input": "U", "instructions": "I", "tools": tools})
    assert fields.prompt_text == "U" + json.dumps(tools) + "I"
    assert fields.routing_hints(None).prefix_text == "U"


def test_a_body_nested_past_what_json_parses_is_a_400_not_a_500():
    from fleetserve.deployments.ingress.protocol import APIError
    from fleetserve.deployments.ingress.request_fields import parse_body

    with pytest.raises(APIError, match="nests too deeply") as raised:
        parse_body(b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert raised.value.status_code == 400


def test_deeply_nested_content_is_read_to_a_bounded_depth():
    # 500 levels of parts parse as JSON; the text under the 16th is not looked for (vLLM refuses such parts).
    content: list = [{"type": "text", "text": "deep"}]
    for _ in range(500):
        content = [{"type": "text", "text": "x", "content": content}]
    fields = read_fields(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": content}]})
    # The message's list is level 0; its parts' text is read at levels 1, 3, ..., 15: 8 of them.
    assert fields.prompt_text == "x" * 8


@pytest.mark.parametrize(("path", "endpoint"), [
    ("/v1/messages", Endpoint.MESSAGES),
    ("/team-a/v1/messages/count_tokens", Endpoint.COUNT_TOKENS),   # under a route prefix
    ("/v1/chat/completions", Endpoint.CHAT),                       # not taken for /v1/completions
    ("/v1/completions", Endpoint.COMPLETIONS),
    ("/v1/models", None),
    ("/v2/rerank", Endpoint.RERANK),                               # Cohere's path, an alias
    ("/team-a/v1/score", Endpoint.SCORE),
])
def test_endpoint_of_path_reads_the_path_under_any_prefix(path, endpoint):
    assert Endpoint.of_path(path) is endpoint
