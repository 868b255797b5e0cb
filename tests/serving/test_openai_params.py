"""Every documented OpenAI parameter of chat and completions, sent through fleetserve to a real engine.

Each one either takes effect (checked against the same request without it) or gets a 400 that names it.
The tiny random model's greedy output is fixed, which is all these comparisons need; the tool and parallel
tool call checks use SmolLM2, which writes calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": PROMPT}]
# 8 tokens, greedy, never stopping early: every variant below is compared against this.
BASE = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.base_url}{path}", json=body, timeout=120)


def completion(served, **fields) -> dict:
    response = post(served, "/v1/completions", {**BASE, "prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def chat(served, **fields) -> dict:
    response = post(served, "/v1/chat/completions", {**BASE, "messages": MESSAGES, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def text(reply: dict, index: int = 0) -> str:
    choice = reply["choices"][index]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def sse_payloads(body: str) -> list[dict]:
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


# ---- what each parameter does, as a check against the parameterless request ------------------------------

def check_penalty(name: str, call: Callable) -> Callable:
    def check(served):
        # The greedy 8 tokens repeat some token (a random model loops); a penalty of 2 breaks the loop.
        assert text(call(served, **{name: 2.0})) != text(call(served))
    return check


def check_logit_bias(call: Callable) -> Callable:
    def check(served):
        first = call(served, max_tokens=1, return_token_ids=True)["choices"][0]["token_ids"][0]
        biased = call(served, max_tokens=1, return_token_ids=True, logit_bias={str(first): -100})
        assert biased["choices"][0]["token_ids"][0] != first
    return check


def check_max_tokens(name: str, call: Callable) -> Callable:
    def check(served):
        assert call(served, **{name: 3})["usage"]["completion_tokens"] == 3
    return check


def check_n(call: Callable) -> Callable:
    def check(served):
        reply = call(served, n=2, temperature=1.0, seed=3)
        assert [choice["index"] for choice in reply["choices"]] == [0, 1]
        assert reply["usage"]["completion_tokens"] == 16  # 2 choices x 8 tokens
    return check


def check_seed(call: Callable) -> Callable:
    def check(served):
        first, again = (text(call(served, temperature=1.0, seed=7)) for _ in range(2))
        assert first == again
        assert text(call(served, temperature=1.0, seed=8)) != first
    return check


def check_temperature(call: Callable) -> Callable:
    def check(served):
        # At temperature 2 over a random model's flat distribution, 8 tokens matching greedy is ~impossible.
        assert text(call(served, temperature=2.0, seed=1)) != text(call(served))
    return check


def check_top_p(call: Callable) -> Callable:
    def check(served):
        # A nucleus of one token is greedy decoding, whatever the seed.
        greedy = text(call(served))
        assert [text(call(served, temperature=1.0, top_p=1e-6, seed=seed)) for seed in (1, 2)] == [greedy, greedy]
    return check


def check_stop(call: Callable) -> Callable:
    def check(served):
        greedy = text(call(served))
        stop = greedy[len(greedy) // 2:len(greedy) // 2 + 2]
        reply = call(served, stop=[stop])
        assert text(reply) == greedy[:greedy.find(stop)]
        assert reply["choices"][0]["finish_reason"] == "stop"
    return check


def check_stream(path: str, call: Callable) -> Callable:
    def check(served):
        response = post(served, path, {**BASE, **_input(path), "stream": True,
                                       "stream_options": {"include_usage": True}})
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response.text)
        pieces = [choice.get("text", choice.get("delta", {}).get("content")) or ""
                  for payload in payloads for choice in payload["choices"]]
        assert "".join(pieces) == text(call(served))
        # stream_options.include_usage: a last chunk with no choices and the usage.
        assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 8
    return check


def check_no_output_effect(name: str, value, call: Callable) -> Callable:
    def check(served):
        # An identifier (OpenAI documents no effect on output); fleetserve reads it for replica affinity.
        assert text(call(served, **{name: value})) == text(call(served))
    return check


def check_refused(path: str, name: str, value) -> Callable:
    def check(served):
        response = post(served, path, {**BASE, **_input(path), name: value})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == name
    return check


def _input(path: str) -> dict:
    return {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}


def check_completion_logprobs(served):
    content = completion(served, logprobs=2)["choices"][0]["logprobs"]
    assert len(content["tokens"]) == 8 and all(len(top) == 2 for top in content["top_logprobs"])


def check_chat_logprobs(served):
    content = chat(served, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(len(item["top_logprobs"]) == 2 for item in content)


def check_echo(served):
    assert text(completion(served, echo=True)) == PROMPT + text(completion(served))


def check_response_format(served):
    schema = {"type": "string", "enum": ["yes", "no"]}
    reply = chat(served, ignore_eos=False, max_tokens=10,
                 response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}})
    assert json.loads(text(reply)) in ("yes", "no")


def check_tool_choice(served):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = chat(served, model="smollm2", messages=ask, ignore_eos=False, max_tokens=40, tools=[WEATHER_TOOL],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}


def check_parallel_tool_calls(served):
    ask = [{"role": "user", "content": "What is the weather in Paris, in Rome and in Oslo?"}]
    reply = chat(served, model="smollm2", messages=ask, ignore_eos=False, max_tokens=120, tools=[WEATHER_TOOL],
                 tool_choice="required", parallel_tool_calls=False)
    assert len(reply["choices"][0]["message"]["tool_calls"]) == 1


def check_suffix(served):
    # vLLM serves suffix only for models with fill-in-the-middle rendering: its own 400, naming it.
    response = post(served, "/v1/completions", {**BASE, "prompt": PROMPT, "suffix": " jumps"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# OpenAI's documented chat parameters (messages and model are every request's), and what each does here.
CHAT_CHECKS = {
    "audio": check_refused(CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    "frequency_penalty": check_penalty("frequency_penalty", chat),
    "function_call": check_refused(CHAT, "function_call", "auto"),
    "functions": check_refused(CHAT, "functions", [{"name": "get_weather", "parameters": {}}]),
    "logit_bias": check_logit_bias(chat),
    "logprobs,top_logprobs": check_chat_logprobs,
    "max_completion_tokens": check_max_tokens("max_completion_tokens", chat),
    "max_tokens": check_max_tokens("max_tokens", chat),
    "metadata": check_refused(CHAT, "metadata", {"team": "a"}),
    "modalities": check_refused(CHAT, "modalities", ["text", "audio"]),
    "n": check_n(chat),
    "parallel_tool_calls": check_parallel_tool_calls,
    "prediction": check_refused(CHAT, "prediction", {"type": "content", "content": "x"}),
    "presence_penalty": check_penalty("presence_penalty", chat),
    "prompt_cache_key": check_no_output_effect("prompt_cache_key", "prefix-a", chat),
    # The ChatML template reads no reasoning_effort: vLLM would drop it there.
    "reasoning_effort": check_refused(CHAT, "reasoning_effort", "low"),
    "response_format": check_response_format,
    "safety_identifier": check_refused(CHAT, "safety_identifier", "user-1"),
    "seed": check_seed(chat),
    "service_tier": check_refused(CHAT, "service_tier", "flex"),
    "stop": check_stop(chat),
    "store": check_refused(CHAT, "store", True),
    "stream,stream_options": check_stream(CHAT, chat),
    "temperature": check_temperature(chat),
    "tools,tool_choice": check_tool_choice,
    "top_p": check_top_p(chat),
    "user": check_no_output_effect("user", "alice", chat),
    "verbosity": check_refused(CHAT, "verbosity", "low"),
    "web_search_options": check_refused(CHAT, "web_search_options", {}),
}
# OpenAI's documented (legacy) completions parameters.
COMPLETION_CHECKS = {
    "best_of": check_refused(COMPLETIONS, "best_of", 2),
    "echo": check_echo,
    "frequency_penalty": check_penalty("frequency_penalty", completion),
    "logit_bias": check_logit_bias(completion),
    "logprobs": check_completion_logprobs,
    "max_tokens": check_max_tokens("max_tokens", completion),
    "n": check_n(completion),
    "presence_penalty": check_penalty("presence_penalty", completion),
    "seed": check_seed(completion),
    "stop": check_stop(completion),
    "stream,stream_options": check_stream(COMPLETIONS, completion),
    "suffix": check_suffix,
    "temperature": check_temperature(completion),
    "top_p": check_top_p(completion),
    "user": check_no_output_effect("user", "alice", completion),
}


@pytest.mark.parametrize("check", CHAT_CHECKS.values(), ids=CHAT_CHECKS.keys())
def test_chat_parameter_takes_effect_or_is_refused(served, check):
    check(served)


@pytest.mark.parametrize("check", COMPLETION_CHECKS.values(), ids=COMPLETION_CHECKS.keys())
def test_completion_parameter_takes_effect_or_is_refused(served, check):
    check(served)
