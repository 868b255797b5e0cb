"""The learning-from-traffic pipeline on the suite's served tiny models, as an SRE runs it.

Routed prompts are recorded by the served app, feedback lands beside them, `fleetserve router label`
turns them into battles (exact-match and LLM-judge scorers), `router train` learns from the battles
and `router calibrate --records` calibrates on the recorded traffic. A judge as small as SmolLM2-135M
says nothing about answer quality; what is asserted is that each step does exactly what it says.
"""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.router.model.labeling import JudgeScorer, parse_verdict
from fleetserve.router.model.routing_data import load_training_data, split_of
from fleetserve.router.model.traffic import FeedbackRecord, RouteRecord, read_records, tenant_hash

pytestmark = pytest.mark.slow
runner = CliRunner()
MAX_TOKENS = 6
# Prompts of this test alone; the two that fall in the train split let `router train` run.
CANDIDATES = [f"In one word, what colour is thing number {i}?" for i in range(40)]


def pick_prompts() -> list[str]:
    train = [p for p in CANDIDATES if split_of(p) == "train"][:2]
    rest = [p for p in CANDIDATES if split_of(p) != "train"][:2]
    return train + rest


def answer(base_url: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    response = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0.0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def cli(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def recorded(served, traffic_dir):
    """Sends this test's prompts through the routed name `auto`; returns them with their request ids."""
    prompts = pick_prompts()
    ids = {}
    for prompt in prompts:
        response = httpx.post(f"{served.base_url}/v1/chat/completions", timeout=60, json={
            "model": "auto", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
        assert response.status_code == 200, response.text
        # One id: Serve's proxy assigns and returns it, the ingress uses it and vLLM names the completion by it.
        (request_id,) = response.headers.get_list("x-request-id")
        assert response.json()["id"] == f"chatcmpl-{request_id}"
        ids[prompt] = request_id
    return prompts, ids


def test_routed_prompts_and_feedback_are_recorded(served, traffic_dir, recorded):
    prompts, ids = recorded
    response = httpx.post(f"{served.base_url}/v1/feedback", timeout=10,
                          json={"request_id": ids[prompts[0]], "thumbs": "down"})
    assert response.status_code == 200 and response.json()["score"] == 0.0
    records = list(read_records(traffic_dir))
    ours = {r.prompt: r for r in records if isinstance(r, RouteRecord) and r.prompt in ids}
    assert set(ours) == set(prompts)
    for prompt, record in ours.items():
        assert (record.request_id, record.route, record.tenant) == (ids[prompt], "auto", tenant_hash("anonymous"))
        assert record.model in ("tiny", "smollm2") and record.strongest == (record.model == "smollm2")
    feedback = [r for r in records if isinstance(r, FeedbackRecord) and r.request_id == ids[prompts[0]]]
    assert [f.score for f in feedback] == [0.0]
    metrics = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    assert 'fleetserve_route_strong_share_target{route="auto"} 0.5' in metrics
    assert 'fleetserve_route_strong_share{route="auto"}' in metrics


def test_exact_match_labels_train_and_recorded_calibration(served, traffic_dir, recorded, tmp_path):
    prompts, _ = recorded
    tiny_answers = {p: answer(served.base_url, "tiny", p) for p in prompts}
    smol_answers = {p: answer(served.base_url, "smollm2", p) for p in prompts}
    # The known answer is tiny's own greedy answer, so tiny is right by construction; SmolLM2 says
    # something else, so tiny wins each battle.
    assert all(tiny_answers[p].strip().lower() != smol_answers[p].strip().lower() for p in prompts)
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"prompt": p, "answer": tiny_answers[p]}) + "\n" for p in prompts))
    battles = tmp_path / "battles.jsonl"
    cli("router", "label", str(traffic_dir), "--url", served.base_url, "--models", "tiny,smollm2",
        "--scorer", "exact", "--answers", str(answers), "--route", "auto", "--max-tokens", str(MAX_TOKENS),
        "--out", str(battles))
    lines = [json.loads(line) for line in battles.read_text().splitlines()]
    assert lines == [{"prompt": p, "model_a": "tiny", "model_b": "smollm2", "winner": "model_a"} for p in prompts]

    checkpoint = tmp_path / "ckpt"
    cli("router", "train", str(battles), "--router", "knn", "--embedder", "hashing-256", "--out", str(checkpoint))
    metadata = json.loads((checkpoint / "metadata.json").read_text())
    assert metadata["training"]["format"] == "battles"
    assert metadata["training"]["num_prompts"] == len(load_training_data(battles).select("train").prompts) == 2
    assert metadata["models"] == ["smollm2", "tiny"]  # tiny won every battle, so it ranks strongest

    result = cli("router", "calibrate", str(checkpoint), "--strong-fraction", "0.5", "--records",
                 str(traffic_dir), "--route", "auto")
    entry = json.loads((checkpoint / "metadata.json").read_text())["calibrations"][0]
    recorded_auto = {r.prompt for r in read_records(traffic_dir) if isinstance(r, RouteRecord) and r.route == "auto"}
    assert (entry["split"], entry["route"], entry["num_prompts"]) == ("recorded traffic", "auto", len(recorded_auto))
    assert f"{entry['threshold']:.6f}" == result.stdout.strip().splitlines()[-1]


def test_the_judge_scorer_asks_the_served_judge_and_maps_its_verdict(served, traffic_dir, recorded, tmp_path):
    prompts, _ = recorded
    # Only this test's records, so the judge is not asked about every prompt the suite routed.
    ours = tmp_path / "ours.jsonl"
    ours.write_text("".join(line + "\n" for file in sorted(traffic_dir.glob("*.jsonl"))
                            for line in file.read_text().splitlines() if json.loads(line).get("prompt") in prompts))
    battles = tmp_path / "judged.jsonl"
    cli("router", "label", str(ours), "--url", served.base_url, "--models", "tiny,smollm2",
        "--scorer", "judge", "--judge-model", "smollm2", "--max-tokens", str(MAX_TOKENS), "--out", str(battles))
    lines = {json.loads(line)["prompt"]: json.loads(line) for line in battles.read_text().splitlines()}
    assert set(lines) == set(prompts)
    for prompt in prompts:
        a, b = answer(served.base_url, "tiny", prompt), answer(served.base_url, "smollm2", prompt)
        text, swapped = JudgeScorer(None, "smollm2").judge_prompt(prompt, a, b)
        verdict = parse_verdict(answer(served.base_url, "smollm2", text, max_tokens=4))
        expected = ("tie" if verdict in (None, "T")
                    else "model_b" if (verdict == "A") == swapped else "model_a")
        assert lines[prompt]["winner"] == expected, (prompt, verdict, swapped)
