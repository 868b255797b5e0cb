"""`fleetserve router train / calibrate / eval` as an SRE runs them, on a synthetic correctness CSV."""

from __future__ import annotations

import csv
import json

import pytest
from factories import synthetic_correctness
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.router.model.quality_router import load_router
from fleetserve.router.model.routing_data import load_training_data

runner = CliRunner()


@pytest.fixture
def data_csv(tmp_path):
    table = synthetic_correctness(num_prompts=600, hard_every=3)
    path = tmp_path / "data.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["prompt", *table.models])
        writer.writerows([prompt, *row] for prompt, row in zip(table.prompts, table.correct.tolist()))
    return path


def run(*args: str):
    result = runner.invoke(app, list(args))
    return result


def test_train_calibrate_eval_round_trip(data_csv, tmp_path):
    checkpoint = tmp_path / "clf"
    result = run("router", "train", str(data_csv), "--router", "classifier", "--embedder", "hashing-256",
                 "--out", str(checkpoint))
    assert result.exit_code == 0, result.output
    metadata = json.loads((checkpoint / "metadata.json").read_text())
    assert metadata["training"]["split"] == "train" and metadata["embedder"] == "hashing-256"
    assert metadata["training"]["num_prompts"] == len(load_training_data(data_csv).select("train").prompts)

    result = run("router", "calibrate", str(checkpoint), "--strong-fraction", "0.3")
    assert result.exit_code == 0, result.output
    threshold = float(result.stdout.strip().splitlines()[-1])
    calibration = load_router(checkpoint).metadata["calibrations"][0]
    assert calibration["threshold"] == pytest.approx(threshold, abs=1e-6)
    assert calibration["split"] == "calibration"

    out = tmp_path / "eval.json"
    result = run("router", "eval", str(data_csv), "--checkpoint", str(checkpoint), "--plot", str(tmp_path / "c.png"),
                 "--json", str(out), "--bootstrap", "100")
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["split"] == "test" and set(figures["routers"]) == {"random", "classifier"}
    # Hard prompts are perfectly separable, so PGR climbs linearly to 1 over the hard share h of the
    # test split: APGR = 1 - h/2 (h is about 1/3, exactly what the hash split put there).
    test = load_training_data(data_csv).select("test")
    hard_share = float((~test.correct[:, 0]).mean())
    assert figures["routers"]["classifier"]["apgr"]["value"] == pytest.approx(1 - hard_share / 2)
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_clear_errors_for_bad_inputs(data_csv, tmp_path):
    result = run("router", "train", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "no such file or folder" in result.output
    result = run("router", "train", str(data_csv), "--router", "forest", "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "unknown router 'forest'" in result.output
    result = run("router", "train", str(data_csv), "--embedder", "word2vec", "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "unknown embedder 'word2vec'" in result.output
    result = run("router", "calibrate", str(tmp_path), "--strong-fraction", "0.3")
    assert result.exit_code == 2 and "cannot load router checkpoint" in result.output
