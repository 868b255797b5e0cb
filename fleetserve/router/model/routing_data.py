"""Training data for the cost/quality router: per-prompt correctness tables and pairwise battles.

Two formats, as RouteLLM uses them:

* a correctness CSV (or a folder of them): a ``prompt`` column, then one boolean column per model
  (``../shared/data/routellm/mmlu/`` has this shape);
* battles as JSONL in RouteLLM's format: ``prompt``, ``model_a``, ``model_b``, ``winner``
  (``model_a``, ``model_b``, ``tie`` or ``tie (bothbad)``).

Every prompt belongs to one split, fixed by a hash of its text, so training, calibration and
evaluation never see each other's rows, whichever command reads the data. Every prompt also belongs
to a group (a ``group`` column or field, else the file's name: MMLU's subject), and the group split
puts whole groups in one split, so evaluation measures prompts of groups the router never saw.
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

Split = Literal["train", "calibration", "test"]
# "prompt": each prompt by its own hash (in-domain); "group": whole groups by the group's hash.
SplitBy = Literal["prompt", "group"]
SPLIT_BYS: tuple[SplitBy, ...] = ("prompt", "group")
GROUP_COLUMN = "group"
# Percent of prompts in each split, by the first 8 bytes of sha256(prompt) mod 100.
SPLIT_PERCENT: dict[Split, tuple[int, int]] = {"train": (0, 60), "calibration": (60, 70), "test": (70, 100)}
_TRUE = {"true", "1", "yes", "t"}
_FALSE = {"false", "0", "no", "f"}
_WINNERS = {"model_a": 1.0, "model_b": 0.0, "tie": 0.5, "tie (bothbad)": 0.5}


class DataError(ValueError):
    """Training data that cannot be read; the message says which file and row."""


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to, the same in every command and every run."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % 100
    for split, (low, high) in SPLIT_PERCENT.items():
        if low <= bucket < high:
            return split
    raise AssertionError(bucket)


def group_split_of(group: str) -> Split:
    """The split a whole group belongs to; salted so it is not the split of a prompt with that text."""
    return split_of(f"group:{group}")


def _kept(prompts: list[str], groups: list[str], split: Split, by: SplitBy) -> list[int]:
    if by == "prompt":
        return [i for i, prompt in enumerate(prompts) if split_of(prompt) == split]
    if by == "group":
        return [i for i, group in enumerate(groups) if group_split_of(group) == split]
    raise ValueError(f"split by must be one of {SPLIT_BYS}, got {by!r}")


@dataclass
class Battles:
    """Pairwise outcomes: in battle i, model_a_ids[i] met model_b_ids[i] on prompts[prompt_ids[i]]."""

    prompts: list[str]
    models: list[str]
    prompt_ids: np.ndarray  # int64 [num_battles]
    model_a_ids: np.ndarray  # int64 [num_battles]
    model_b_ids: np.ndarray  # int64 [num_battles]
    # 1.0 when model a won, 0.0 when model b won, 0.5 for a tie.
    outcomes: np.ndarray  # float32 [num_battles]
    # The group of each prompt (a ``group`` field, else the file's name), aligned with prompts.
    groups: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.groups:
            self.groups = [""] * len(self.prompts)

    def select(self, split: Split, by: SplitBy = "prompt") -> Battles:
        """The battles whose prompt (or the prompt's group) is in one split, with prompts renumbered."""
        keep = _kept(self.prompts, self.groups, split, by)
        remap = np.full(len(self.prompts), -1, dtype=np.int64)
        remap[keep] = np.arange(len(keep))
        rows = remap[self.prompt_ids] >= 0
        return Battles([self.prompts[i] for i in keep], self.models, remap[self.prompt_ids[rows]],
                       self.model_a_ids[rows], self.model_b_ids[rows], self.outcomes[rows],
                       [self.groups[i] for i in keep])

    def points(self) -> np.ndarray:
        """Each model's share of points on each prompt, float64 [num_prompts, num_models] (NaN: never played)."""
        points = np.zeros((len(self.prompts), len(self.models)))
        games = np.zeros((len(self.prompts), len(self.models)))
        np.add.at(points, (self.prompt_ids, self.model_a_ids), self.outcomes)
        np.add.at(points, (self.prompt_ids, self.model_b_ids), 1.0 - self.outcomes)
        np.add.at(games, (self.prompt_ids, self.model_a_ids), 1.0)
        np.add.at(games, (self.prompt_ids, self.model_b_ids), 1.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return points / games

    def strength_order(self) -> list[str]:
        """Models from weakest to strongest by share of points won (ties count half)."""
        points = np.zeros(len(self.models))
        games = np.zeros(len(self.models))
        np.add.at(points, self.model_a_ids, self.outcomes)
        np.add.at(points, self.model_b_ids, 1.0 - self.outcomes)
        np.add.at(games, self.model_a_ids, 1.0)
        np.add.at(games, self.model_b_ids, 1.0)
        share = points / np.maximum(games, 1.0)
        return [self.models[i] for i in np.argsort(share, kind="stable")]


@dataclass
class CorrectnessTable:
    """Whether each model answered each prompt correctly."""

    prompts: list[str]
    models: list[str]
    correct: np.ndarray  # bool [num_prompts, num_models]
    # The group of each prompt (a ``group`` column, else the file's name), aligned with prompts.
    groups: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.groups:
            self.groups = [""] * len(self.prompts)

    def select(self, split: Split, by: SplitBy = "prompt") -> CorrectnessTable:
        """The prompts in one split: by each prompt's hash, or by its group's."""
        keep = _kept(self.prompts, self.groups, split, by)
        return CorrectnessTable([self.prompts[i] for i in keep], self.models, self.correct[keep],
                                [self.groups[i] for i in keep])

    def accuracy(self, model: str) -> float:
        return float(self.correct[:, self.models.index(model)].mean())

    def strength_order(self) -> list[str]:
        """Models from weakest to strongest by accuracy."""
        return sorted(self.models, key=self.accuracy)

    def to_battles(self) -> Battles:
        """Every pair of models on every prompt: the correct one wins; both right or both wrong tie."""
        num_prompts, num_models = self.correct.shape
        pairs = [(a, b) for a in range(num_models) for b in range(a + 1, num_models)]
        prompt_ids = np.repeat(np.arange(num_prompts), len(pairs))
        model_a = np.tile([a for a, _ in pairs], num_prompts)
        model_b = np.tile([b for _, b in pairs], num_prompts)
        right_a = self.correct[prompt_ids, model_a]
        right_b = self.correct[prompt_ids, model_b]
        outcomes = np.where(right_a == right_b, 0.5, right_a.astype(np.float32)).astype(np.float32)
        return Battles(self.prompts, self.models, prompt_ids, model_a.astype(np.int64),
                       model_b.astype(np.int64), outcomes, list(self.groups))


TrainingData = CorrectnessTable | Battles


def _data_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted([*path.glob("*.csv"), *path.glob("*.jsonl")])
        if not files:
            raise DataError(f"{path}: no .csv or .jsonl files in this folder")
        return files
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    return [path]


def data_sha256(path: str | Path) -> str:
    """Hash of the data files' names and bytes, recorded in checkpoints."""
    digest = hashlib.sha256()
    for file in _data_files(Path(path)):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _parse_bool(value: str, where: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise DataError(f"{where}: expected a boolean (True/False/1/0), got {value!r}")


def _read_csv(file: Path) -> CorrectnessTable:
    with file.open(newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        model_columns = [i for i, name in enumerate(header or []) if i > 0 and name != GROUP_COLUMN]
        if not header or header[0] != "prompt" or not model_columns:
            raise DataError(f"{file}: expected a header 'prompt,<model>,<model>...' (and optionally "
                            f"'{GROUP_COLUMN}'), got {header}")
        group_column = header.index(GROUP_COLUMN) if GROUP_COLUMN in header else None
        prompts, groups, rows = [], [], []
        for line, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise DataError(f"{file}:{line}: expected {len(header)} columns, got {len(row)}")
            prompts.append(row[0])
            groups.append(row[group_column] if group_column is not None else file.stem)
            rows.append([_parse_bool(row[i], f"{file}:{line} column {header[i]!r}") for i in model_columns])
    return CorrectnessTable(prompts, [header[i] for i in model_columns],
                            np.array(rows, dtype=bool).reshape(len(rows), len(model_columns)), groups)


def _read_jsonl(file: Path, models: list[str], battles: list[tuple[str, int, int, float]],
                groups: dict[str, str]) -> None:
    for line, text in enumerate(file.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
            prompt, winner = record["prompt"], record["winner"]
            names = (record["model_a"], record["model_b"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise DataError(f"{file}:{line}: expected a JSON object with prompt, model_a, model_b, winner "
                            f"({type(error).__name__}: {error})") from None
        if isinstance(prompt, list):  # multi-turn arena prompts: route on the last turn, as serving does
            prompt = prompt[-1] if prompt else ""
        if winner not in _WINNERS:
            raise DataError(f"{file}:{line}: winner must be one of {sorted(_WINNERS)}, got {winner!r}")
        ids = []
        for name in names:
            if name not in models:
                models.append(name)
            ids.append(models.index(name))
        battles.append((str(prompt), ids[0], ids[1], _WINNERS[winner]))
        groups.setdefault(str(prompt), str(record.get(GROUP_COLUMN, file.stem)))


def load_training_data(path: str | Path) -> TrainingData:
    """Reads correctness CSVs (a file or a folder of them) or a battles JSONL file.

    Raises:
        DataError: naming the file and line of the first problem.
    """
    files = _data_files(Path(path))
    kinds = {file.suffix for file in files}
    if kinds == {".csv"}:
        tables = [_read_csv(file) for file in files]
        models = tables[0].models
        for file, table in zip(files, tables):
            if table.models != models:
                raise DataError(f"{file}: model columns {table.models} differ from {files[0].name}'s {models}")
        return CorrectnessTable([p for t in tables for p in t.prompts], models,
                                np.concatenate([t.correct for t in tables]), [g for t in tables for g in t.groups])
    if kinds == {".jsonl"}:
        models: list[str] = []
        rows: list[tuple[str, int, int, float]] = []
        groups: dict[str, str] = {}
        for file in files:
            _read_jsonl(file, models, rows, groups)
        if not rows:
            raise DataError(f"{path}: no battles")
        prompts = sorted({row[0] for row in rows})
        index = {prompt: i for i, prompt in enumerate(prompts)}
        return Battles(prompts, models, np.array([index[r[0]] for r in rows], dtype=np.int64),
                       np.array([r[1] for r in rows], dtype=np.int64), np.array([r[2] for r in rows], dtype=np.int64),
                       np.array([r[3] for r in rows], dtype=np.float32), [groups[p] for p in prompts])
    raise DataError(f"{path}: mixes {sorted(kinds)} files; use either correctness CSVs or battles JSONL")
