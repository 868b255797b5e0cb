"""fleetserve batch: OpenAI batch files run against an endpoint (here an httpx mock), retried, stopped and resumed."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.loadtest.batch import BatchConfig, BatchFileError, BatchLine, done_ids, read_batch, run_batch


def line(custom_id: str, prompt: str = "hi", url: str = "/v1/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": 2, **body}}


def batch_file(path: Path, *lines: dict | str) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in lines))
    return path


def lines(*custom_ids: str) -> list[BatchLine]:
    return [BatchLine.model_validate(line(custom_id, prompt=custom_id)) for custom_id in custom_ids]


class Server:
    """Answers each request from a script of (status, headers) per prompt, then with a completion of the prompt."""

    def __init__(self, script: dict[str, list] | None = None) -> None:
        self.script = script or {}
        self.sent: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.sent.append((request.url.path, body["prompt"]))
        planned = self.script.get(body["prompt"], [])
        if planned:
            answer = planned.pop(0)
            if isinstance(answer, Exception):
                raise answer
            status, headers = answer
            return httpx.Response(status, headers=headers, json={"error": {"message": "busy", "code": status}})
        return httpx.Response(200, headers={"x-request-id": f"req-{body['prompt']}"},
                              json={"choices": [{"text": body["prompt"].upper()}],
                                    "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


def run(server: Server, batch: list[BatchLine], output: Path, stop: asyncio.Event | None = None, **config):
    config = {"max_concurrency": 2, "retry_base_s": 0.001, **config}
    return asyncio.run(run_batch(BatchConfig("http://test/v1", **config), batch, output, stop=stop,
                                 transport=httpx.MockTransport(server)))


def results(output: Path) -> dict[str, dict]:
    written = [json.loads(text) for text in output.read_text().splitlines()]
    assert len({item["custom_id"] for item in written}) == len(written)  # each request written once
    return {item["custom_id"]: item for item in written}


def test_each_answer_is_written_in_openais_batch_output_format(tmp_path):
    output = tmp_path / "out.jsonl"
    summary = run(Server(), lines("a", "b", "c"), output)
    written = results(output)
    assert written["b"]["response"] == {"status_code": 200, "request_id": "req-b", "body": {
        "choices": [{"text": "B"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}}
    assert written["b"]["error"] is None and written["b"]["id"].startswith("batch_req_")
    # 3 answers x 3 prompt tokens and 2 completion tokens.
    assert (summary.num_ok, summary.prompt_tokens, summary.completion_tokens) == (3, 9, 6)


def test_a_refusal_for_load_is_sent_again_and_any_other_answer_is_final(tmp_path):
    server = Server({"a": [(429, {"retry-after": "0"}), (503, {})], "b": [(400, {})]})
    output = tmp_path / "out.jsonl"
    summary = run(server, lines("a", "b"), output)
    written = results(output)
    assert written["a"]["response"]["status_code"] == 200  # the third try
    assert written["b"]["response"]["status_code"] == 400  # the caller's error: one try
    assert [prompt for _, prompt in server.sent].count("a") == 3
    assert (summary.num_retries, dict(summary.statuses)) == (2, {200: 1, 400: 1})


def test_refusals_naming_a_retry_after_are_waited_out_beyond_max_retries_until_max_wait(tmp_path):
    server = Server({"a": [(503, {"retry-after": "0"})] * 5, "b": [(429, {"retry-after": "0"})] * 5})
    output = tmp_path / "out.jsonl"
    run(server, lines("a"), output, max_retries=0)
    assert (len(server.sent), results(output)["a"]["response"]["status_code"]) == (6, 200)
    run(server, lines("b"), output, max_retries=0, max_wait_s=0.0)
    assert results(output)["b"]["response"]["status_code"] == 429  # no time to wait: its first answer stands


def test_a_request_refused_on_every_try_keeps_its_last_answer(tmp_path):
    server = Server({"a": [(503, {})] * 10})
    output = tmp_path / "out.jsonl"
    run(server, lines("a"), output, max_retries=2)
    assert len(server.sent) == 3  # the first try and 2 retries
    assert results(output)["a"]["response"]["status_code"] == 503


def test_a_request_never_answered_is_written_with_the_error(tmp_path):
    server = Server({"a": [httpx.ConnectError("refused")] * 3, "b": [httpx.ReadTimeout("slow")]})
    output = tmp_path / "out.jsonl"
    summary = run(server, lines("a", "b"), output, max_retries=2)
    written = results(output)
    assert written["a"]["response"] is None
    assert written["a"]["error"] == {"code": "no_response", "message": "ConnectError: refused"}
    assert written["b"]["response"]["status_code"] == 200  # answered on its second try
    assert dict(summary.statuses) == {None: 1, 200: 1}


def test_a_resumed_run_sends_only_what_the_output_lacks(tmp_path):
    output = tmp_path / "out.jsonl"
    run(Server(), lines("a", "b"), output)
    with output.open("a") as out:
        out.write('{"id": "batch_req_x", "custom_id": "c", "resp')  # a crash mid-write
    server = Server()
    summary = run(server, lines("a", "b", "c", "d"), output)
    assert sorted(prompt for _, prompt in server.sent) == ["c", "d"]  # c's cut line does not count
    assert sorted(results(output)) == ["a", "b", "c", "d"]
    assert (summary.num_skipped, summary.num_done) == (2, 2)


def test_a_stopped_run_writes_whole_lines_and_a_resumed_one_finishes_it(tmp_path):
    output = tmp_path / "out.jsonl"
    stop = asyncio.Event()

    class StopAfterTwo(Server):
        def __call__(self, request):
            if len(self.sent) == 2:
                stop.set()
            return super().__call__(request)

    first = run(StopAfterTwo(), lines(*"abcdef"), output, stop=stop, max_concurrency=1)
    # The stop came with the third request, which the mock answers at once (a network's would be abandoned);
    # no request starts after it.
    assert (first.stopped, first.num_done) == (True, 3)
    second = run(Server(), lines(*"abcdef"), output)
    assert (second.stopped, second.num_skipped, second.num_done) == (False, 3, 3)
    assert sorted(results(output)) == list("abcdef")


@pytest.mark.parametrize(("text", "message"), [
    ("not json", "line 2: line: Invalid JSON"),
    (json.dumps({**line("x"), "method": "GET"}), "line 2: method: Input should be 'POST'"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "line 2: custom_id: Field required"),
    (json.dumps({**line("x"), "extra": 1}), "line 2: extra: Extra inputs are not permitted"),
    (json.dumps(line("x", url="/v1/chat")), "line 2: url '/v1/chat' is not a path a batch can run"),
    (json.dumps(line("x", stream=True)), "line 2: body.stream is true"),
    (json.dumps(line("a")), "line 2: custom_id 'a' is line 1's too"),
])
def test_a_batch_file_that_cannot_run_is_refused_naming_the_line(tmp_path, text, message):
    with pytest.raises(BatchFileError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        read_batch(batch_file(tmp_path / "in.jsonl", line("a"), text))


def test_blank_lines_are_skipped_and_an_empty_file_refused(tmp_path):
    assert [item.custom_id for item in read_batch(batch_file(tmp_path / "a.jsonl", line("a"), "", line("b")))] == [
        "a", "b"]
    with pytest.raises(BatchFileError, match="holds no requests"):
        read_batch(batch_file(tmp_path / "b.jsonl", ""))


def test_done_ids_of_no_output_are_none(tmp_path):
    assert done_ids(tmp_path / "none.jsonl") == {}


def test_the_cli_refuses_to_append_to_an_output_unless_told(tmp_path):
    source = batch_file(tmp_path / "in.jsonl", line("a"))
    output = batch_file(tmp_path / "out.jsonl", {"custom_id": "a", "response": None})
    refused = CliRunner().invoke(app, ["batch", str(source), "-o", str(output)])
    assert refused.exit_code == 2 and "--resume" in refused.output
    # --resume: the one request has its result already, so nothing is sent (no server runs here).
    resumed = CliRunner().invoke(app, ["batch", str(source), "-o", str(output), "--resume",
                                       "--base-url", "http://127.0.0.1:9"])
    assert resumed.exit_code == 1, resumed.output  # the result on file is no 2xx answer
    assert re.search(r"already done \(resumed\) +│ 1, 1 without a 2xx", resumed.output)
    assert "1/1 ok 0, failed 1" in resumed.output and len(output.read_text().splitlines()) == 1
