"""Parameters vLLM would accept and not act on are found, by path, before vLLM sees the request."""

from __future__ import annotations

import json

import pytest

from fleetserve.platform.api_types import Endpoint
from fleetserve.platform.unread_params import RequestCheck, template_variables

# A template that reads the messages and the generation prompt flag, and one kwarg: `greeting`.
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if greeting %}{{ greeting }}{% endif %}"
            "{% if add_generation_prompt %}>{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": "m", "messages": MESSAGES, **fields}


def paths(endpoint: Endpoint, payload: dict, template: str | None = TEMPLATE) -> list[str]:
    return [param.path for param in RequestCheck(template).unread(endpoint, payload)]


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}), ("verbosity", "low"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("metadata", {"k": "v"}),
    ("safety_identifier", "u1"), ("store", True), ("service_tier", "flex"), ("guided_json", {"type": "object"}),
])
def test_openai_fields_vllm_lacks_are_unread_on_chat(field, value):
    assert paths(Endpoint.CHAT, chat(**{field: value})) == [field]


def test_fields_vllm_reads_are_not_reported():
    payload = chat(max_completion_tokens=3, temperature=0.5, top_p=0.9, seed=1, stop=["x"], n=2, logprobs=True,
                   top_logprobs=2, logit_bias={"5": 1}, frequency_penalty=0.1, presence_penalty=0.1, user="u",
                   response_format={"type": "json_object"}, stream=True, stream_options={"include_usage": True},
                   parallel_tool_calls=False, min_p=0.1, top_k=3, ignore_eos=True)
    assert paths(Endpoint.CHAT, payload) == []


def test_defaults_and_nulls_ask_for_nothing_and_pass():
    # OpenAI's defaults for fields vLLM lacks, and null for any field, need no reader.
    assert paths(Endpoint.CHAT, chat(store=False, service_tier="auto", audio=None, metadata=None)) == []


def test_prompt_cache_key_is_read_by_the_platform():
    assert paths(Endpoint.CHAT, chat(prompt_cache_key="tenant-a")) == []


@pytest.mark.parametrize("endpoint, payload", [
    (Endpoint.CHAT, chat()), (Endpoint.COMPLETIONS, {"model": "m", "prompt": "hi"}),
    (Endpoint.RESPONSES, {"model": "m", "input": "hi"}),
])
def test_a_priority_is_unread_unless_the_engine_schedules_by_it(endpoint, payload):
    first_come = RequestCheck(None)
    by_priority = RequestCheck(None, schedules_by_priority=True)
    assert [param.path for param in first_come.unread(endpoint, {**payload, "priority": 5})] == ["priority"]
    assert first_come.unread(endpoint, {**payload, "priority": 0}) == []  # vLLM's default asks for nothing
    assert by_priority.unread(endpoint, {**payload, "priority": 5}) == []


def test_nested_unknown_fields_are_found_by_path():
    tool = {"type": "function", "function": {"name": "f", "parameters": {}, "bogus": 1}}
    payload = chat(tools=[tool], stream=True, stream_options={"include_usage": True, "every": 2})
    assert paths(Endpoint.CHAT, payload) == ["tools.0.function.bogus", "stream_options.every"]


def test_template_variables_the_template_does_not_read_are_unread():
    payload = chat(chat_template_kwargs={"greeting": "yo", "enable_thinking": False}, reasoning_effort="low",
                   documents=[{"text": "d"}])
    assert paths(Endpoint.CHAT, payload) == ["reasoning_effort", "documents", "chat_template_kwargs.enable_thinking"]


def test_template_check_is_skipped_without_a_template():
    assert paths(Endpoint.CHAT, chat(chat_template_kwargs={"enable_thinking": False}), template=None) == []


def test_apply_chat_template_arguments_count_as_read():
    # transformers' apply_chat_template takes continue_final_message itself, whatever the template reads.
    assert paths(Endpoint.CHAT, chat(chat_template_kwargs={"continue_final_message": False})) == []


@pytest.mark.parametrize("endpoint, payload, expected", [
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "best_of": 2, "suffix": "s"}, ["best_of"]),
    (Endpoint.EMBEDDINGS, {"model": "m", "input": "x", "dimensions": 8, "user": "u", "foo": 1}, ["foo"]),
    (Endpoint.MESSAGES, {"model": "m", "max_tokens": 3, "messages": MESSAGES, "foo": 1}, ["foo"]),
    (Endpoint.RESPONSES, {"model": "m", "input": "x", "foo": 1}, ["foo"]),
    (Endpoint.TOKENIZE, {"model": "m", "prompt": "x", "foo": 1}, ["foo"]),
    (Endpoint.DETOKENIZE, {"model": "m", "tokens": [1], "foo": 1}, ["foo"]),
    (Endpoint.SCORE, {"model": "m", "text_1": "q", "text_2": ["d"], "foo": 1}, ["foo"]),
    # top_n is rerank's: on /score, vLLM would return every pair.
    (Endpoint.SCORE, {"model": "m", "queries": "q", "documents": ["d"], "top_n": 1}, ["top_n"]),
    # vLLM always returns the documents: asking for them needs nothing, asking it not to is refused.
    (Endpoint.RERANK, {"model": "m", "query": "q", "documents": ["d"], "return_documents": True}, []),
    (Endpoint.RERANK, {"model": "m", "query": "q", "documents": ["d"], "return_documents": False},
     ["return_documents"]),
    (Endpoint.CLASSIFY, {"model": "m", "input": "x", "foo": 1}, ["foo"]),
    (Endpoint.CLASSIFY, {"model": "m", "messages": MESSAGES, "foo": 1}, ["foo"]),
])
def test_every_endpoint_is_checked(endpoint, payload, expected):
    assert paths(endpoint, payload) == expected


def test_a_body_vllm_refuses_is_left_to_vllm():
    # stream_options without stream: vLLM's own validator answers it, naming the field.
    assert paths(Endpoint.CHAT, chat(stream_options={"include_usage": True}, audio={})) == []


def test_refusal_is_openai_error_json_naming_the_first_parameter():
    body = json.dumps(chat(audio={}, functions=[{"name": "f"}])).encode()
    error = json.loads(RequestCheck(TEMPLATE).refusal(Endpoint.CHAT, body))["error"]
    assert (error["param"], error["code"], error["type"]) == ("audio", "unsupported_parameter",
                                                               "invalid_request_error")
    assert error["message"].startswith("Unsupported parameter(s): audio, functions. vLLM would ignore them")


@pytest.mark.parametrize(("stores_responses", "background", "refused"), [
    (True, True, True),     # stored where no client can fetch it (GET /v1/responses/{id} is not routed)
    (True, False, False),
    (False, True, False),   # vLLM refuses it itself: background needs its response store
])
def test_a_background_response_is_refused_where_vllm_would_store_it(stores_responses, background, refused):
    body = json.dumps({"model": "m", "input": "hi", "background": background}).encode()
    refusal = RequestCheck(None, stores_responses=stores_responses).refusal(Endpoint.RESPONSES, body)
    assert (refusal is not None) == refused
    if refused:
        error = json.loads(refusal)["error"]
        assert (error["param"], error["code"]) == ("background", "unsupported_parameter")
        assert error["message"].startswith("A background response is fetched with GET /v1/responses/{id}")


def test_refusal_is_none_for_a_clean_or_non_json_body():
    check = RequestCheck(TEMPLATE)
    assert check.refusal(Endpoint.CHAT, json.dumps(chat()).encode()) is None
    assert check.refusal(Endpoint.CHAT, b"not json") is None


def test_template_variables_of_a_chatml_template():
    template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert template_variables(template) == {"messages", "add_generation_prompt"}
