"""Difficulty features: exact values on prompts built to show each one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleetserve.router.model.difficulty import FEATURE_NAMES, difficulty_features
from fleetserve.router.model.embedders import make_embedder


def features(text: str) -> dict[str, float]:
    return dict(zip(FEATURE_NAMES, difficulty_features(text)))


def test_a_multiple_choice_arithmetic_prompt():
    prompt = "Calculate 12 + 30 in kg.\nA. 42 kg\nB. 18 kg\nAnswer:"
    f = features(prompt)
    question = "Calculate 12 + 30 in kg."
    assert f["log_question_chars"] == pytest.approx(math.log1p(len(question)) / 6)
    # Options "42 kg" and "18 kg" (the trailing "Answer:" line is dropped): 10 characters.
    assert f["log_option_chars"] == pytest.approx(math.log1p(10) / 6)
    assert f["question_digit_share"] == pytest.approx(4 / len(question) * 10)  # 1, 2, 3, 0
    assert f["math_symbols"] == pytest.approx(1 / 5)  # "+"
    assert f["question_numbers"] == pytest.approx(2 / 5)  # 12 and 30
    assert f["numeric_option_share"] == pytest.approx(2 / 4)  # both options are numbers with a unit
    assert f["units"] == pytest.approx(2 / 3)  # "42 kg", "18 kg"; "30 in" is not a unit
    assert f["asks_to_compute"] == 1.0
    assert f["has_code"] == 0.0 and f["statement_pair"] == 0.0 and f["negations"] == 0.0


def test_code_negation_and_statements():
    assert features("What does print(x) return?")["has_code"] == 1.0
    assert features("All of these are true EXCEPT which NOT")["negations"] == 2.0
    f = features("Statement 1 | A group is abelian. Statement 2 | x\nA. True, True\nB. False, False\nAnswer:")
    assert f["statement_pair"] == 1.0 and f["truth_pair_options"] == 1.0


def test_free_text_has_no_options_and_the_embedder_is_cached():
    f = features("Write a haiku about the sea")
    assert f["log_option_chars"] == 0.0 and f["numeric_option_share"] == 0.0
    embedder = make_embedder("difficulty")
    vector = embedder.embed_one("Write a haiku about the sea")
    assert vector is embedder.embed_one("Write a haiku about the sea")
    assert vector.shape == (len(FEATURE_NAMES),) and not embedder.normalized
    assert np.array_equal(embedder.embed(["Write a haiku about the sea"])[0], vector)
