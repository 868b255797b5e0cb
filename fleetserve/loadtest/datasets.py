"""Workloads for ``fleetserve bench``: what each request asks for.

With a tokenizer, synthetic prompts have exact token lengths (random token ids, decoded). Without
one, they are built from a fixed word list, one word per token, which is close for most tokenizers.
"""

from __future__ import annotations

import json
import random as random_module
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload."""

    prompt: str
    # Prompt length in tokens (exact with a tokenizer, else approximate).
    prompt_len: int
    # Output tokens to ask for (max_tokens).
    max_tokens: int
    # Shared-prefix workloads: which prefix group the request belongs to; None otherwise.
    group_id: int | None = None
    # Recorded traces: seconds after the run's start to send it; None sends on the configured arrival rate.
    send_at_s: float | None = None


class DatasetError(ValueError):
    """A dataset that cannot be read or built; the message says what was expected."""


_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact be have do say get make go know take see come think "
          "look want give use find tell ask seem feel try leave call good new first last long great little own "
          "other old right big high different small large next early young important few public bad same able").split()


class PromptMaker:
    """Builds prompts of a given token length, exactly when a tokenizer is available."""

    def __init__(self, tokenizer: Tokenizer | None, rng: random_module.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self._vocab_size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else 0

    def tokens(self, length: int) -> list[int]:
        # Skip the first ids: they are usually special tokens.
        return [self.rng.randrange(100, max(self._vocab_size, 101)) for _ in range(length)]

    def text(self, length: int) -> str:
        if self.tokenizer is None:
            return " ".join(self.rng.choice(_WORDS) for _ in range(length))
        # Decode-then-encode can change the count; trim or pad until it is exact.
        text = self.tokenizer.decode(self.tokens(length))
        for _ in range(4):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == length:
                break
            ids = ids[:length] if len(ids) > length else ids + self.tokens(length - len(ids))
            text = self.tokenizer.decode(ids)
        return text

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _lengths(rng: random_module.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(max(low, 1), max(high, 1)))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                   maker: PromptMaker) -> list[RequestSpec]:
    """Random prompts; lengths uniform in mean x [1 - range_ratio, 1 + range_ratio], after a common prefix."""
    if not 0 <= range_ratio < 1:
        raise DatasetError("--random-range-ratio must be in [0, 1)")
    prefix = maker.text(prefix_len) + " " if prefix_len else ""
    specs = []
    for _ in range(num_prompts):
        length = _lengths(maker.rng, input_len, range_ratio)
        specs.append(RequestSpec(prefix + maker.text(length), prefix_len + length,
                                 _lengths(maker.rng, output_len, range_ratio)))
    return specs


def shared_prefix_dataset(num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int, output_len: int,
                          maker: PromptMaker) -> list[RequestSpec]:
    """N groups, each with its own common prefix of P tokens; requests cycle through the groups, shuffled."""
    if num_groups < 1:
        raise DatasetError("--shared-prefix-groups must be at least 1")
    prefixes = [maker.text(prefix_len) for _ in range(num_groups)]
    specs = [RequestSpec(f"{prefixes[index % num_groups]} {maker.text(suffix_len)}", prefix_len + suffix_len,
                         output_len, group_id=index % num_groups) for index in range(num_prompts)]
    maker.rng.shuffle(specs)
    return specs


def sharegpt_dataset(path: Path, num_prompts: int, maker: PromptMaker,
                     output_len: int | None = None) -> list[RequestSpec]:
    """First human turn of each ShareGPT conversation; output length from the reply unless given."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DatasetError(f"cannot read ShareGPT file {path}: {error}") from None
    specs = []
    for row in rows if isinstance(rows, list) else []:
        turns = row.get("conversations") or row.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        if not prompt or not reply:
            continue
        length = output_len or max(1, maker.count(reply))
        specs.append(RequestSpec(prompt, maker.count(prompt), length))
        if len(specs) == num_prompts:
            break
    if not specs:
        raise DatasetError(f"{path} holds no ShareGPT conversations (a list of {{'conversations': [...]}})")
    return _cycle(specs, num_prompts)


def jsonl_dataset(path: Path, num_prompts: int, maker: PromptMaker, default_max_tokens: int) -> list[RequestSpec]:
    """One JSON object per line: {"prompt": str, "max_tokens": int (optional)}."""
    specs = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise DatasetError(f"cannot read {path}: {error.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DatasetError(f"{path}:{number}: expected a JSON object with a 'prompt'") from None
        specs.append(RequestSpec(prompt, maker.count(prompt), int(row.get("max_tokens", default_max_tokens))))
    if not specs:
        raise DatasetError(f"{path} is empty")
    return _cycle(specs, num_prompts)


def trace_dataset(path: Path, maker: PromptMaker, start_s: float = 0.0, duration_s: float | None = None,
                  rate_scale: float = 1.0, length_scale: float = 1.0, max_len: int | None = None) -> list[RequestSpec]:
    """A recorded trace's requests (``fleetserve.loadtest.recorded``), each sent at its recorded time with a
    prompt of its recorded length.

    Args:
        path: the trace CSV (timestamp, prompt tokens, output tokens).
        maker: builds the prompts.
        start_s: where in the trace (seconds, before ``rate_scale``) the replay starts.
        duration_s: how many of the trace's seconds to replay; None: to its end.
        rate_scale: plays the window this many times faster.
        length_scale: multiplies every token count (a small model's context holds a real trace's prompts
            only scaled down).
        max_len: prompt plus output tokens at most this (the model's context): longer prompts are cut.

    Raises:
        DatasetError: an unreadable trace, bad scales, or an empty window.
    """
    from fleetserve.loadtest.recorded import TraceError, from_csv, window

    if length_scale <= 0:
        raise DatasetError(f"--trace-length-scale must be positive, got {length_scale:g}")
    try:
        requests = window(from_csv(path), start_s, duration_s if duration_s is not None else float("inf"))
    except TraceError as error:
        raise DatasetError(str(error)) from None
    if rate_scale <= 0:
        raise DatasetError(f"--rate-scale must be positive, got {rate_scale:g}")
    if not requests:
        raise DatasetError(f"{path} has no requests in [{start_s:g}, {start_s + (duration_s or 0):g}) s")
    specs = []
    for request in requests:
        output = max(1, round(request.output_tokens * length_scale))
        prompt = max(1, round(request.prompt_tokens * length_scale))
        if max_len is not None:
            if output >= max_len:
                output = max_len - 1
            prompt = min(prompt, max_len - output)
        specs.append(RequestSpec(maker.text(prompt), prompt, output, send_at_s=request.arrival_s / rate_scale))
    return specs


def _cycle(specs: list[RequestSpec], num_prompts: int) -> list[RequestSpec]:
    return [specs[index % len(specs)] for index in range(num_prompts)]
