"""Difficulty features: what makes a prompt hard whatever its subject.

An embedding of the prompt's words says what the prompt is about, and a router trained on it
learns which subjects the weak model fails; that does not carry over to subjects it never saw
(docs/router.md, group-held-out split). These features describe the work a prompt asks for
instead: how long it is, how much arithmetic, code, negation and multi-statement reasoning it holds.
Each is scaled to roughly [0, 1] for typical prompts, with no statistics fitted to any data set, so
the vector means the same on every platform's traffic.
"""

from __future__ import annotations

import re
import numpy as np

from fleetserve.router.model.embedders import RowEmbedder

# A multiple-choice option line ("\nA. ..."); text before the first one is the question.
_OPTION = re.compile(r"\n([A-J])[.)] ")
_MATH = re.compile(r"[=+*/^<>√∫∑π%$]|\\frac|sqrt|\blog\b|\bsin\b|\bcos\b")
_CODE = re.compile(r"\b(def|return|print|int|void|class|while|import|function|var|elif)\b|[{};]|==|\+\+")
_NEGATION = re.compile(r"\b(EXCEPT|NOT|LEAST|FALSE|INCORRECT)\b")
_UNIT = re.compile(r"\d\s?(kg|g|m|s|J|N|W|V|K|mol|Hz|eV|cm|mm|km|L|mL|%|years|°)\b")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_NUMERIC_OPTION = re.compile(r"[-−$]?[\d.,/\s^×x*eE+\-−]+\s*\S{0,6}")
_ROMAN = re.compile(r"\b(I|II|III|IV)\b")
_ASKS_TO_COMPUTE = re.compile(r"\b(calculate|compute|solve|find|how many|how much|what is the value|probability)\b",
                              re.IGNORECASE)
_PERSONAL = re.compile(r"\b(you|your|I|my|we)\b")
_TRUTH_PAIRS = {"True, True", "False, False", "True, False", "False, True"}

FEATURE_NAMES: tuple[str, ...] = (
    "log_question_chars", "log_option_chars", "question_digit_share", "math_symbols", "has_code",
    "question_numbers", "numeric_option_share", "statement_pair", "negations", "roman_numerals", "units",
    "mean_word_chars", "question_lines", "asks_to_compute", "capitalised_word_share", "personal",
    "truth_pair_options",
)


def difficulty_features(text: str) -> list[float]:
    """The feature vector of one prompt, in ``FEATURE_NAMES`` order."""
    parts = _OPTION.split(text)
    question = parts[0]
    options = [parts[i + 1].replace("\nAnswer:", "").strip() for i in range(1, len(parts) - 1, 2)]
    words = question.split()
    numeric_options = sum(bool(_NUMERIC_OPTION.fullmatch(option)) for option in options)
    return [
        float(np.log1p(len(question))) / 6,
        float(np.log1p(sum(map(len, options)))) / 6,
        sum(c.isdigit() for c in question) / max(len(question), 1) * 10,
        len(_MATH.findall(text)) / 5,
        float(bool(_CODE.search(text))),
        len(_NUMBER.findall(question)) / 5,
        numeric_options / 4,
        float("Statement 1" in text),
        float(len(_NEGATION.findall(question))),
        float(bool(_ROMAN.search(text))),
        len(_UNIT.findall(text)) / 3,
        float(np.mean([len(w) for w in words])) / 6 if words else 0.0,
        question.count("\n") / 3,
        float(bool(_ASKS_TO_COMPUTE.search(question))),
        sum(w[:1].isupper() for w in words[1:]) / max(len(words), 1),
        float(bool(_PERSONAL.search(question))),
        float(any(option in _TRUTH_PAIRS for option in options)),
    ]


class DifficultyEmbedder(RowEmbedder):
    """Hand-written difficulty features (no model, no torch); rows are not L2-normalised."""

    normalized = False

    def __init__(self) -> None:
        super().__init__()
        self.dim = len(FEATURE_NAMES)
        self.spec = "difficulty-v1"

    def _embed_uncached(self, text: str) -> np.ndarray:
        vector = np.asarray(difficulty_features(text), dtype=np.float32)
        vector.flags.writeable = False
        return vector
