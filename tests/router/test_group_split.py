"""Groups in routing data, the split that holds whole groups out, and the bootstrap over groups."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fleetserve.router.model.evaluation import bootstrap_samples
from fleetserve.router.model.routing_data import DataError, group_split_of, load_training_data


def write_subjects(folder, num_subjects=40, rows_per_subject=5):
    for s in range(num_subjects):
        lines = ["prompt,weak,strong", *(f"subject {s} question {r},True,{r % 2 == 0}" for r in range(rows_per_subject))]
        (folder / f"subject_{s}.csv").write_text("\n".join(lines) + "\n")


def test_a_folder_of_csvs_groups_prompts_by_file_name(tmp_path):
    write_subjects(tmp_path, num_subjects=3, rows_per_subject=2)
    data = load_training_data(tmp_path)
    assert data.groups == ["subject_0", "subject_0", "subject_1", "subject_1", "subject_2", "subject_2"]
    assert data.models == ["weak", "strong"]


def test_a_group_column_overrides_the_file_name_and_is_not_a_model(tmp_path):
    (tmp_path / "mixed.csv").write_text("prompt,group,weak,strong\nq1,algebra,True,False\nq2,law,False,True\n")
    data = load_training_data(tmp_path / "mixed.csv")
    assert data.groups == ["algebra", "law"] and data.models == ["weak", "strong"]
    assert data.correct.tolist() == [[True, False], [False, True]]


def test_a_csv_with_only_a_group_column_names_the_missing_models(tmp_path):
    (tmp_path / "bad.csv").write_text("prompt,group\nq1,algebra\n")
    with pytest.raises(DataError, match="expected a header 'prompt,<model>,<model>...'"):
        load_training_data(tmp_path / "bad.csv")


def test_battles_take_their_group_field(tmp_path):
    lines = [{"prompt": "a", "model_a": "x", "model_b": "y", "winner": "tie", "group": "chat"},
             {"prompt": "b", "model_a": "x", "model_b": "y", "winner": "model_a"}]
    (tmp_path / "arena.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    battles = load_training_data(tmp_path / "arena.jsonl")
    assert battles.groups == ["chat", "arena"]  # sorted prompts a, b; b falls back to the file's name
    assert battles.select("train", by="group").groups == [g for g in battles.groups if group_split_of(g) == "train"]


def test_the_group_split_keeps_every_group_whole_and_apart(tmp_path):
    write_subjects(tmp_path)
    data = load_training_data(tmp_path)
    parts = {split: data.select(split, by="group") for split in ("train", "calibration", "test")}
    groups = {split: set(part.groups) for split, part in parts.items()}
    assert not groups["train"] & groups["test"] and not groups["train"] & groups["calibration"]
    assert not groups["calibration"] & groups["test"]
    assert sum(len(part.prompts) for part in parts.values()) == 200  # 40 subjects x 5 rows
    for split, part in parts.items():
        assert all(part.groups.count(g) == 5 for g in groups[split])  # whole groups
        assert part.correct.shape == (len(part.prompts), 2)
    # By prompt, the same subjects land in several splits.
    by_prompt = {split: set(data.select(split).groups) for split in ("train", "test")}
    assert by_prompt["train"] & by_prompt["test"]


def test_group_bootstrap_draws_whole_groups():
    groups = ["a", "a", "a", "b", "c", "c"]
    samples = bootstrap_samples(len(groups), num_bootstrap=50, seed=1, groups=groups)
    members = {"a": [0, 1, 2], "b": [3], "c": [4, 5]}
    for sample in samples:
        rest = sample.tolist()
        while rest:  # each sample is a concatenation of whole groups, 3 groups drawn
            group = next(name for name, rows in members.items() if rest[:len(rows)] == rows)
            rest = rest[len(members[group]):]
    assert {len(s) for s in samples} <= set(range(3, 10))  # 3 draws of sizes 1-3
    assert len({tuple(s) for s in samples}) > 1
    plain = bootstrap_samples(6, num_bootstrap=3, seed=1)
    assert [len(s) for s in plain] == [6, 6, 6] and all(np.all((s >= 0) & (s < 6)) for s in plain)
