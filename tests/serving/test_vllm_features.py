"""vLLM's request features through fleetserve, on real engines, with the official openai client.

The replicas run vLLM's own OpenAI app, so each feature here is vLLM's; what these tests check is that
fleetserve's path (ingress, Serve, replica) carries every one of them through intact.
"""

from __future__ import annotations

import itertools
import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

# strict: vLLM (like OpenAI) holds a call's arguments to the tool's schema only for strict tools.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.api_url, api_key="unused", max_retries=0, timeout=120)


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.base_url}{path}", json=body, timeout=120)


def test_json_schema_output_validates_against_its_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_named_tool_choice_returns_a_call_with_valid_arguments(client):
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER_TOOL], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_required_tool_choice_returns_tool_calls_with_valid_arguments(client):
    reply = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER_TOOL], max_tokens=60,
                                           temperature=0, tool_choice="required")
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    assert {call.function.name for call in calls} == {"get_weather"}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_auto_tool_choice_is_served_out_of_the_box(client):
    # The packaged SmolLM2 gets a tool-aware chat template and the hermes parser: "auto" is accepted
    # (Ray Serve LLM and bare vLLM answer 400 without --enable-auto-tool-choice and a parser).
    reply = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER_TOOL], max_tokens=30,
                                           temperature=0, tool_choice="auto")
    assert reply.choices[0].finish_reason in {"stop", "length", "tool_calls"}


def test_n_gives_that_many_choices(client):
    reply = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5, n=2, seed=1,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 10  # 2 choices x 5 tokens


def test_logit_bias_changes_the_greedy_token(served):
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
            "return_token_ids": True}
    first = post(served, "/v1/completions", body).json()["choices"][0]["token_ids"][0]
    biased = post(served, "/v1/completions", {**body, "logit_bias": {str(first): -100}}).json()
    assert biased["choices"][0]["token_ids"][0] != first


def test_echo_returns_the_prompt_first(client):
    reply = client.completions.create(model="smollm2", prompt="One, two,", max_tokens=3, temperature=0, echo=True)
    assert reply.choices[0].text.startswith("One, two,")


def streamed_token_ids(response: httpx.Response) -> list[list[int]]:
    """The token ids of each streamed chunk that carries any."""
    assert response.status_code == 200, response.text
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [choice["token_ids"] for event in events[:-1] for choice in json.loads(event)["choices"]
            if choice["token_ids"]]


def ends_of_chunks(chunks: list[list[int]]) -> set[int]:
    """How many tokens had been streamed at the end of each chunk."""
    return set(itertools.accumulate(map(len, chunks)))


def test_stream_interval_groups_the_tokens_after_the_first(served):
    # vLLM sends the first token alone, then one chunk per 4 new tokens, and what is left at the end: 17
    # tokens end chunks at 1, 5, 9, 13 and 17. vLLM may merge chunks its consumer has not taken yet (its
    # output collector), so a chunk can end at fewer of them, never elsewhere. The path may join several
    # events into one write, but never merges or splits an event.
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 17, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    grouped = streamed_token_ids(post(served, "/v1/completions", {**body, "stream_interval": 4}))
    plain = streamed_token_ids(post(served, "/v1/completions", body))
    assert ends_of_chunks(grouped) <= {1, 5, 9, 13, 17} and max(ends_of_chunks(grouped)) == 17
    # Without it, chunks end between those points too (one token per step), and the tokens are the same.
    assert ends_of_chunks(plain) - {1, 5, 9, 13, 17}
    assert sum(grouped, []) == sum(plain, [])


def test_tokenize_round_trips(served):
    tokens = post(served, "/tokenize", {"model": "smollm2", "prompt": "Hello world"}).json()["tokens"]
    assert len(tokens) == 2
    assert post(served, "/detokenize", {"model": "smollm2", "tokens": tokens}).json()["prompt"] == "Hello world"


def test_responses_and_anthropic_messages_are_served(served):
    responses = post(served, "/v1/responses", {"model": "smollm2", "input": "Say hi", "max_output_tokens": 4,
                                               "temperature": 0})
    assert responses.status_code == 200, responses.text
    assert responses.json()["object"] == "response"
    messages = post(served, "/v1/messages", {"model": "smollm2", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "Say hi"}]})
    assert messages.status_code == 200, messages.text
    assert messages.json()["type"] == "message" and messages.json()["content"][0]["type"] == "text"
    # Anthropic's messages.count_tokens counts what the same messages cost as input (a 404 before).
    counted = post(served, "/v1/messages/count_tokens", {"model": "smollm2", "system": "Be brief.",
                                                         "messages": [{"role": "user", "content": "Say hi"}]})
    created = post(served, "/v1/messages", {"model": "smollm2", "max_tokens": 1, "system": "Be brief.",
                                            "messages": [{"role": "user", "content": "Say hi"}]})
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == created.json()["usage"]["input_tokens"] > 0


def test_vllm_validation_errors_reach_the_client_as_vllm_returns_them(served):
    response = post(served, "/v1/completions", {"model": "tiny", "prompt": ""})
    # vLLM's own 400 for an empty prompt (the old ingress answered 500 here).
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    # A generate-only model has no embeddings endpoint in vLLM: its error, not a 5xx.
    embeddings = post(served, "/v1/embeddings", {"model": "tiny", "input": "x"})
    assert embeddings.status_code == 404
    assert embeddings.json()["error"]["message"] == "model `tiny` does not serve /v1/embeddings"
