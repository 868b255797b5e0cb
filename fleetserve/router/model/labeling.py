"""Battles from recorded traffic: send each prompt to two served models and score the answers.

``fleetserve router label`` samples recorded prompts, asks both models through the platform's own
OpenAI endpoint (greedy, so a rerun gives the same battles), and writes RouteLLM's battles JSONL,
which ``fleetserve router train`` reads. Scorers are pluggable:

* ``ExactMatchScorer``: for prompts with known answers; an answer is right when its first word (or,
  for a longer expected answer, its whole text) equals the expected one, case and punctuation aside.
* ``JudgeScorer``: an LLM judge served by the platform itself picks the better answer. A judge as
  small as the test models proves nothing about quality; what is tested is the mechanics.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import httpx

from fleetserve.router.model.traffic import RouteRecord, read_records

Winner = Literal["model_a", "model_b", "tie", "tie (bothbad)"]
_WORD = re.compile(r"[\w.+-]+")
JUDGE_PROMPT = (
    "You compare two answers to the same question.\n\nQuestion:\n{prompt}\n\nAnswer A:\n{first}\n\n"
    "Answer B:\n{second}\n\nWhich answer is better? Reply with one letter: A, B, or T for a tie."
)


class LabelError(ValueError):
    """Labelling that cannot go on; the message says why."""


class ChatClient:
    """Greedy chat completions through the platform's OpenAI endpoint.

    Args:
        base_url: the platform's URL (``http://host:port``).
        api_key: sent as a bearer token when auth is on.
        max_tokens: output budget per answer.
    """

    def __init__(self, base_url: str, api_key: str | None = None, max_tokens: int = 64, timeout_s: float = 120.0):
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.max_tokens = max_tokens
        self.num_calls = 0

    def answer(self, model: str, prompt: str, max_tokens: int | None = None) -> str:
        """The model's greedy answer to one user message.

        Raises:
            LabelError: naming the model and the platform's error when the call fails.
        """
        response = self._http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens or self.max_tokens, "temperature": 0.0})
        self.num_calls += 1
        if response.status_code != 200:
            raise LabelError(f"{model}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()["choices"][0]["message"]["content"] or ""

    def close(self) -> None:
        self._http.close()


class Scorer(Protocol):
    """Decides a battle between two answers to one prompt."""

    def winner(self, prompt: str, answer_a: str, answer_b: str) -> Winner | None:
        """The battle's outcome; None when this scorer cannot judge the prompt (it is skipped)."""
        ...


def _normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def answer_matches(answer: str, expected: str) -> bool:
    """Whether an answer gives the expected one: its first word for a one-word answer, else all of it."""
    expected_words = _normalise(expected).split()
    got = _normalise(answer).split()
    if len(expected_words) == 1:
        return bool(got) and got[0].rstrip(".") == expected_words[0].rstrip(".")
    return got == expected_words


@dataclass
class ExactMatchScorer:
    """Scores prompts with known answers; the right answer wins, two right or two wrong tie."""

    # Prompt -> expected answer.
    answers: dict[str, str]

    @classmethod
    def from_jsonl(cls, path: str | Path) -> ExactMatchScorer:
        """Reads ``{"prompt": ..., "answer": ...}`` lines.

        Raises:
            LabelError: naming the file and line of a malformed one.
        """
        answers = {}
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                answers[str(record["prompt"])] = str(record["answer"])
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise LabelError(f"{path}:{number}: expected a JSON object with prompt and answer ({error})") from None
        return cls(answers)

    def winner(self, prompt: str, answer_a: str, answer_b: str) -> Winner | None:
        if prompt not in self.answers:
            return None
        right_a, right_b = (answer_matches(a, self.answers[prompt]) for a in (answer_a, answer_b))
        if right_a != right_b:
            return "model_a" if right_a else "model_b"
        return "tie" if right_a else "tie (bothbad)"


@dataclass
class JudgeScorer:
    """A served model judges which answer is better.

    The answers are shown in an order fixed by a hash of the prompt, so the judge's preference for
    the first (or second) position does not always favour the same model.
    """

    client: ChatClient
    judge_model: str
    # Verdicts that were not A, B or T, counted as ties.
    num_unparsed: int = 0

    def judge_prompt(self, prompt: str, answer_a: str, answer_b: str) -> tuple[str, bool]:
        """The judge's prompt and whether model a's answer is shown second."""
        swapped = hashlib.sha256(prompt.encode()).digest()[0] % 2 == 1
        first, second = (answer_b, answer_a) if swapped else (answer_a, answer_b)
        return JUDGE_PROMPT.format(prompt=prompt, first=first, second=second), swapped

    def winner(self, prompt: str, answer_a: str, answer_b: str) -> Winner | None:
        text, swapped = self.judge_prompt(prompt, answer_a, answer_b)
        verdict = parse_verdict(self.client.answer(self.judge_model, text, max_tokens=4))
        if verdict is None:
            self.num_unparsed += 1
            return "tie"
        if verdict == "T":
            return "tie"
        shown_first_wins = verdict == "A"
        return "model_b" if shown_first_wins == swapped else "model_a"


def parse_verdict(text: str) -> Literal["A", "B", "T"] | None:
    """The judge's letter: the first A, B or T standing alone at the start of its reply."""
    match = re.match(r"\W*(A|B|T)\b", text.strip(), flags=re.IGNORECASE)
    return match.group(1).upper() if match else None  # type: ignore[return-value]


def recorded_prompts(path: str | Path, route: str | None = None) -> list[str]:
    """The distinct prompts of recorded routed requests (of one route), in first-seen order."""
    seen: dict[str, None] = {}
    for record in read_records(path):
        if isinstance(record, RouteRecord) and (route is None or record.route == route):
            seen.setdefault(record.prompt, None)
    return list(seen)


def sample_prompts(prompts: list[str], num_prompts: int, seed: int) -> list[str]:
    """A seeded sample, in the order given: the same records and seed give the same prompts."""
    if num_prompts >= len(prompts):
        return list(prompts)
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(f"{seed}:{p}".encode()).digest())
    chosen = set(ranked[:num_prompts])
    return [p for p in prompts if p in chosen]


@dataclass(frozen=True)
class Battle:
    """One labelled battle, in RouteLLM's battles format."""

    prompt: str
    model_a: str
    model_b: str
    winner: Winner

    def to_json(self) -> str:
        return json.dumps({"prompt": self.prompt, "model_a": self.model_a, "model_b": self.model_b,
                           "winner": self.winner}, ensure_ascii=False)


def label(prompts: Iterable[str], client: ChatClient, model_a: str, model_b: str, scorer: Scorer,
          on_step=None) -> tuple[list[Battle], int]:
    """Asks both models each prompt and scores them.

    Returns:
        The battles, and how many prompts the scorer could not judge (skipped).
    """
    battles, skipped = [], 0
    for prompt in prompts:
        answer_a, answer_b = client.answer(model_a, prompt), client.answer(model_b, prompt)
        winner = scorer.winner(prompt, answer_a, answer_b)
        if winner is None:
            skipped += 1
        else:
            battles.append(Battle(prompt, model_a, model_b, winner))
        if on_step is not None:
            on_step()
    return battles, skipped
