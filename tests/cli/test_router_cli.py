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
    result = run("router", "train", str(data_csv), "--router", "random", "--embedder", "minilm", "--out",
                 str(tmp_path / "x"))
    assert result.exit_code == 2 and "--embedder does not apply to --router random" in result.output
    result = run("router", "calibrate", str(tmp_path), "--strong-fraction", "0.3")
    assert result.exit_code == 2 and "cannot load router checkpoint" in result.output
    result = run("router", "calibrate", str(tmp_path), "--strong-fraction", "0.3", "--route", "auto")
    assert result.exit_code == 2 and "--route picks a route's prompts from --records" in result.output


def test_a_random_router_is_trained_without_an_embedder(data_csv, tmp_path):
    result = run("router", "train", str(data_csv), "--router", "random", "--out", str(tmp_path / "random"))
    assert result.exit_code == 0, result.output
    # Before, it loaded MiniLM and recorded it in the checkpoint, which loading then ignored.
    assert "embedder" not in result.output
    assert json.loads((tmp_path / "random" / "metadata.json").read_text())["embedder"] is None
    assert load_router(tmp_path / "random").embedder is None


@pytest.fixture
def subjects_folder(tmp_path):
    # 40 subjects of 15 prompts: in the "hard" subjects (every third) only the strong model is right.
    folder = tmp_path / "subjects"
    folder.mkdir()
    for s in range(40):
        hard = s % 3 == 0
        rows = [f"{'prove this difficult theorem' if hard else 'say hello politely'} s{s} q{r},{not hard},True"
                for r in range(15)]
        (folder / f"subject_{s}.csv").write_text("prompt,weak-model,strong-model\n" + "\n".join(rows) + "\n")
    return folder


def test_group_split_trains_calibrates_and_evaluates_on_unseen_groups(subjects_folder, tmp_path):
    checkpoint = tmp_path / "knn"
    result = run("router", "train", str(subjects_folder), "--router", "knn", "--embedder", "hashing-256",
                 "--split-by", "group", "--out", str(checkpoint))
    assert result.exit_code == 0, result.output
    metadata = json.loads((checkpoint / "metadata.json").read_text())
    data = load_training_data(subjects_folder)
    train = data.select("train", by="group")
    assert metadata["training"]["split_by"] == "group"
    assert metadata["training"]["num_prompts"] == len(train.prompts) == 15 * len(set(train.groups))
    assert "train loss —" in result.output  # knn has no loss

    result = run("router", "calibrate", str(checkpoint), "--strong-fraction", "0.3")
    assert result.exit_code == 0, result.output
    calibration = data.select("calibration", by="group")
    assert f"of {len(calibration.prompts)} calibration prompts" in " ".join(result.output.split())

    out = tmp_path / "eval.json"
    result = run("router", "eval", str(subjects_folder), "--checkpoint", str(checkpoint), "--json", str(out),
                 "--bootstrap", "50")
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    test = data.select("test", by="group")
    assert figures["split_by"] == "group" and figures["num_groups"] == len(set(test.groups))
    assert figures["routers"]["knn"]["num_prompts"] == len(test.prompts)
    # Unseen subjects that share the words of the trained hard ones: a perfect ranking again,
    # so APGR = 1 - hard share / 2.
    hard_share = float((~test.correct[:, 0]).mean())
    assert figures["routers"]["knn"]["apgr"]["value"] == pytest.approx(1 - hard_share / 2)


def test_eval_refuses_checkpoints_trained_on_different_splits(subjects_folder, tmp_path):
    for split_by in ("group", "prompt"):
        result = run("router", "train", str(subjects_folder), "--router", "classifier", "--embedder", "hashing-256",
                     "--split-by", split_by, "--out", str(tmp_path / split_by))
        assert result.exit_code == 0, result.output
    result = run("router", "eval", str(subjects_folder), "--checkpoint", str(tmp_path / "group"),
                 "--checkpoint", str(tmp_path / "prompt"))
    assert result.exit_code == 2 and "trained on different splits" in result.output
    result = run("router", "train", str(subjects_folder), "--split-by", "subject", "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "--split-by must be one of prompt, group" in result.output
