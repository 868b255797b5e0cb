"""OpenAI's Batch API: uploaded files and batch records kept in a folder, each batch's requests sent through the
platform's own front door (``fleetserve.loadtest.batch.run_batch``, as ``fleetserve batch`` sends a file) with the
submitter's key, so routing, tenants and admission apply to every line as to any request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetserve.deployments.batches.records import (ACTIVE, BatchStatus, Reply, batch_object, file_object,
                                                    list_page)
from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.loadtest.batch import BATCH_URLS, BatchConfig, BatchFileError, BatchOutcome, read_batch, run_batch

logger = logging.getLogger(__name__)
# The only completion window OpenAI offers; a batch not done by then stops, as "expired".
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
# How often a running batch's request counts are written to its record.
SAVE_PERIOD_S = 1.0


class CreateBatch(BaseModel):
    """The body of POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    # Every line's url must be this one.
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def _write_checked(path: Path, content: bytes) -> None:
    path.write_bytes(content)
    read_batch(path)


class BatchService:
    """The files and batches of every tenant, each seen only by the tenant that made it (``owner``; None with auth
    off), kept under ``folder`` across restarts.

    Args:
        folder: where files, batch records and results are kept.
        base_url: the platform's own front door, which each batch's requests go through.
        max_concurrency: requests of one batch in flight at once.
        clock: seconds since the epoch.
        transport: an httpx transport in place of the network (tests).
    """

    def __init__(self, folder: Path, base_url: str, max_concurrency: int = 16,
                 clock: Callable[[], float] = time.time, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.files_dir, self.batches_dir = folder / "files", folder / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        self.base_url, self.max_concurrency, self.clock, self.transport = base_url, max_concurrency, clock, transport
        self.files = {path.stem: json.loads(path.read_text()) for path in self.files_dir.glob("*.json")}
        self.batches = {path.stem: json.loads(path.read_text()) for path in self.batches_dir.glob("*.json")}
        # Batch id -> the event that stops its run (cancel, expiry) and the run itself.
        self._stops: dict[str, asyncio.Event] = {}
        self._runs: dict[str, asyncio.Task] = {}
        self._saved_at: dict[str, float] = {}
        self._recover()

    async def call(self, op: str, *args: Any) -> Reply:
        """Runs one API operation (a public method's name); an APIError becomes its OpenAI error reply."""
        try:
            return await getattr(self, op)(*args)
        except APIError as error:
            return Reply(error.status_code, error.body())

    # --- files -------------------------------------------------------------------------------------------------

    async def upload(self, owner: str | None, filename: str, purpose: str, content: bytes) -> Reply:
        """POST /v1/files: a batch input file, every line checked before it is kept."""
        if purpose != "batch":
            raise APIError(f"purpose {purpose!r} is not stored here: this platform keeps files for its Batch API "
                           f"(purpose 'batch')", param="purpose", code="invalid_purpose")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        path = self.files_dir / f"{file_id}.jsonl"
        try:  # off the event loop: a file of 200 MiB takes seconds, and running batches go on meanwhile
            await asyncio.to_thread(_write_checked, path, content)
        except (BatchFileError, UnicodeDecodeError) as error:
            path.unlink()
            raise APIError(f"{filename}: {error}", param="file", code="invalid_batch_file") from None
        return Reply(200, self._keep_file(owner, file_id, filename, purpose, len(content)))

    async def list_files(self, owner: str | None, purpose: str | None = None) -> Reply:
        """GET /v1/files: the owner's files, newest first."""
        files = [record["object"] for record in self.files.values() if record["owner"] == owner
                 and (purpose is None or record["object"]["purpose"] == purpose)]
        return Reply(200, list_page(files, after=None, limit=len(files) or 1))

    async def get_file(self, owner: str | None, file_id: str) -> Reply:
        """GET /v1/files/{file_id}."""
        return Reply(200, self._file(owner, file_id)["object"])

    async def file_content(self, owner: str | None, file_id: str) -> Reply:
        """GET /v1/files/{file_id}/content: the file's bytes."""
        self._file(owner, file_id)
        return Reply(200, (self.files_dir / f"{file_id}.jsonl").read_bytes())

    async def delete_file(self, owner: str | None, file_id: str) -> Reply:
        """DELETE /v1/files/{file_id}. A running batch keeps its requests: it read them when it was created."""
        self._file(owner, file_id)
        (self.files_dir / f"{file_id}.jsonl").unlink(missing_ok=True)
        (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)
        del self.files[file_id]
        return Reply(200, {"id": file_id, "object": "file", "deleted": True})

    # --- batches -----------------------------------------------------------------------------------------------

    async def create_batch(self, owner: str | None, api_key: str | None, body: Any) -> Reply:
        """POST /v1/batches: starts running the input file's requests with ``api_key``, kept in memory only."""
        try:
            request = CreateBatch.model_validate(body)
        except ValidationError as error:
            first = error.errors()[0]
            raise APIError(f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}",
                           param=".".join(map(str, first["loc"])) or None) from None
        if request.endpoint not in BATCH_URLS:
            raise APIError(f"endpoint {request.endpoint!r} is not one a batch can run: {', '.join(BATCH_URLS)}",
                           param="endpoint")
        source = self._file(owner, request.input_file_id, param="input_file_id")["object"]
        if source["purpose"] != "batch":
            raise APIError(f"file {source['id']!r} has purpose {source['purpose']!r}, not 'batch'",
                           param="input_file_id")
        lines = await asyncio.to_thread(read_batch, self.files_dir / f"{source['id']}.jsonl")
        other = next((number for number, line in enumerate(lines, 1) if line.url != request.endpoint), None)
        if other is not None:
            raise APIError(f"request {other} of file {source['id']!r} is for {lines[other - 1].url}, and this batch "
                           f"runs {request.endpoint}: every request of a batch is for its endpoint", param="endpoint")
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(self.clock())
        batch = batch_object(batch_id, request.endpoint, source["id"], request.completion_window, now,
                             now + COMPLETION_WINDOW_S[request.completion_window], len(lines), request.metadata)
        self.batches[batch_id] = {"owner": owner, "object": batch}
        self._save(batch_id)
        self._stops[batch_id] = asyncio.Event()
        self._runs[batch_id] = asyncio.create_task(self._run(batch_id, lines, api_key))
        return Reply(200, batch)

    async def get_batch(self, owner: str | None, batch_id: str) -> Reply:
        """GET /v1/batches/{batch_id}."""
        return Reply(200, self._batch(owner, batch_id))

    async def list_batches(self, owner: str | None, after: str | None = None, limit: int = 20) -> Reply:
        """GET /v1/batches: the owner's batches, newest first, ``limit`` after the one named ``after``."""
        if not 1 <= limit <= 100:
            raise APIError(f"limit is {limit}; it must be 1 to 100", param="limit")
        batches = [record["object"] for record in self.batches.values() if record["owner"] == owner]
        return Reply(200, list_page(batches, after, limit))

    async def cancel_batch(self, owner: str | None, batch_id: str) -> Reply:
        """POST /v1/batches/{batch_id}/cancel: no further request starts; those in flight are abandoned. The
        batch ends ``cancelled`` with the results it has."""
        batch = self._batch(owner, batch_id)
        if batch["status"] not in ACTIVE:
            raise APIError(f"batch {batch_id!r} is {batch['status']}, not running", 409, param="batch_id",
                           code="batch_not_running")
        if batch["status"] != BatchStatus.CANCELLING:
            batch["status"], batch["cancelling_at"] = BatchStatus.CANCELLING.value, int(self.clock())
            self._save(batch_id)
            self._stops[batch_id].set()
        return Reply(200, batch)

    async def wait(self, batch_id: str) -> None:
        """Until the batch's run, if any, has ended (tests; shutdown)."""
        run = self._runs.get(batch_id)
        if run is not None:
            await asyncio.shield(run)

    # --- internals ---------------------------------------------------------------------------------------------

    async def _run(self, batch_id: str, lines: list, api_key: str | None) -> None:
        batch = self.batches[batch_id]["object"]
        stop = self._stops[batch_id]
        expired = asyncio.Event()
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(max(batch["expires_at"] - self.clock(), 0.0), lambda: (expired.set(), stop.set()))

        def on_done(outcome: BatchOutcome) -> None:
            batch["request_counts"]["completed" if outcome.ok else "failed"] += 1
            if self.clock() - self._saved_at.get(batch_id, 0.0) >= SAVE_PERIOD_S:
                self._save(batch_id)

        config = BatchConfig(base_url=self.base_url, max_concurrency=self.max_concurrency, api_key=api_key)
        errors = None
        try:
            await run_batch(config, lines, self._results_path(batch_id), on_done=on_done, stop=stop,
                            transport=self.transport)
        except Exception as error:  # noqa: BLE001 - the results file unwritable: the batch fails, saying why
            logger.exception("batch %s failed", batch_id)
            errors = [{"code": "batch_failed", "message": f"{type(error).__name__}: {error}"}]
        finally:
            expiry.cancel()
        if errors is not None:
            final = BatchStatus.FAILED
        elif batch["status"] == BatchStatus.CANCELLING:
            final = BatchStatus.CANCELLED
        else:
            final = BatchStatus.EXPIRED if expired.is_set() else BatchStatus.COMPLETED
        await asyncio.to_thread(self._finish, batch_id, final, errors)
        self._stops.pop(batch_id, None)

    def _finish(self, batch_id: str, status: BatchStatus, errors: list[dict[str, Any]] | None = None) -> None:
        """Splits the results into the output file (2xx answers) and the error file (the rest), and ends the batch
        with ``status``."""
        record = self.batches[batch_id]
        batch = record["object"]
        batch["status"], batch["finalizing_at"] = BatchStatus.FINALIZING.value, int(self.clock())
        results = self._results_path(batch_id)
        answered, failed = [], []
        for raw in results.read_bytes().splitlines() if results.exists() else []:
            line = json.loads(raw)
            ok = 200 <= ((line.get("response") or {}).get("status_code") or 0) < 300
            (answered if ok else failed).append(raw + b"\n")
        batch["request_counts"].update(completed=len(answered), failed=len(failed))
        for key, lines in (("output_file_id", answered), ("error_file_id", failed)):
            if lines:
                file_id = f"file-{uuid.uuid4().hex[:24]}"
                (self.files_dir / f"{file_id}.jsonl").write_bytes(b"".join(lines))
                kind = key.split("_")[0]
                self._keep_file(record["owner"], file_id, f"{batch_id}_{kind}.jsonl", "batch_output",
                                sum(map(len, lines)))
                batch[key] = file_id
        if errors:
            batch["errors"] = {"object": "list", "data": [{"line": None, "param": None, **e} for e in errors]}
        batch["status"] = status.value
        batch[f"{status.value}_at"] = int(self.clock())
        self._save(batch_id)

    def _recover(self) -> None:
        """Ends the batches a stopped service left running with the results they had: their submitters' keys
        were never stored, so their remaining requests cannot be sent for them."""
        for batch_id, record in self.batches.items():
            status = record["object"]["status"]
            if status == BatchStatus.CANCELLING:
                self._finish(batch_id, BatchStatus.CANCELLED)
            elif status in ACTIVE:
                self._finish(batch_id, BatchStatus.FAILED, [{
                    "code": "batch_service_restarted",
                    "message": "the batch service restarted while this batch ran; its results so far are in its "
                               "output and error files, and the requests without one can be sent in a new batch"}])

    def _keep_file(self, owner: str | None, file_id: str, filename: str, purpose: str, num_bytes: int) -> dict:
        record = {"owner": owner, "object": file_object(file_id, filename, purpose, num_bytes, int(self.clock()))}
        (self.files_dir / f"{file_id}.json").write_text(json.dumps(record))
        self.files[file_id] = record
        return record["object"]

    def _file(self, owner: str | None, file_id: str, param: str = "file_id") -> dict[str, Any]:
        record = self.files.get(file_id)
        if record is None or record["owner"] != owner:  # another tenant's file is no file of this one
            raise APIError(f"No such File object: {file_id}", 404, "not_found_error", param=param,
                           code="file_not_found")
        return record

    def _batch(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        record = self.batches.get(batch_id)
        if record is None or record["owner"] != owner:
            raise APIError(f"No such Batch object: {batch_id}", 404, "not_found_error", param="batch_id",
                           code="batch_not_found")
        return record["object"]

    def _results_path(self, batch_id: str) -> Path:
        return self.batches_dir / f"{batch_id}.results.jsonl"

    def _save(self, batch_id: str) -> None:
        path = self.batches_dir / f"{batch_id}.json"
        scratch = path.with_suffix(".json.tmp")
        scratch.write_text(json.dumps(self.batches[batch_id]))
        scratch.replace(path)  # a crash mid-write keeps the last whole record
        self._saved_at[batch_id] = self.clock()
