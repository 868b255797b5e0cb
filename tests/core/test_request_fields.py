"""What the ingress reads from a request: the session key the replica router reads, and the outputs it asks for."""

from __future__ import annotations

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
