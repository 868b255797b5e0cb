"""The session key the replica router reads, from the fields of a request."""

from __future__ import annotations

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
