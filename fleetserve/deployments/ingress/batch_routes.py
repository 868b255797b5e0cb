"""/v1/files and /v1/batches: the ingress's side of OpenAI's Batch API, which the batch service answers for the
calling tenant."""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.deployments.ingress.request_fields import parse_body, read_body

FILES_PATH = "/v1/files"
OFF_MESSAGE = ("this platform runs no Batch API: add `batches: {}` to its config to serve /v1/files and /v1/batches "
               "(or send a batch file with `fleetserve batch`)")


class BatchCalls(Protocol):
    """The batch service: the plain one in process, or its Serve deployment through a handle."""

    async def call(self, op: str, *args: Any) -> Any: ...


def add_batch_routes(app: FastAPI, batches: BatchCalls | None, max_body_bytes: int, max_file_bytes: int) -> None:
    """Adds the Batch API's paths to ``app``; without ``batches`` each answers 404 saying how to turn it on."""

    async def answer(raw: Request, op: str, *args: Any) -> Response:
        if batches is None:
            raise APIError(OFF_MESSAGE, 404, "not_found_error", code="batches_off")
        principal = getattr(raw.state, "principal", None)
        reply = await batches.call(op, principal.tenant if principal is not None else None, *args)
        if isinstance(reply.body, bytes):
            return Response(reply.body, status_code=reply.status_code, media_type="application/octet-stream")
        return JSONResponse(reply.body, status_code=reply.status_code)

    @app.post(FILES_PATH)
    async def upload(raw: Request) -> Response:
        if batches is None:
            return await answer(raw, "upload")
        form = await raw.form(max_files=1, max_fields=4)
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise APIError("a `file` part holding the batch file is required", param="file")
        if not isinstance(purpose, str):
            raise APIError("a `purpose` part is required ('batch')", param="purpose")
        content = await file.read()
        if len(content) > max_file_bytes:  # sent without a Content-Length, which the front door checks
            raise APIError(f"the file is {len(content)} bytes; the limit is {max_file_bytes}", param="file",
                           code="request_too_large")
        return await answer(raw, "upload", file.filename or "upload.jsonl", purpose, content)

    @app.get(FILES_PATH)
    async def list_files(raw: Request, purpose: str | None = None) -> Response:
        return await answer(raw, "list_files", purpose)

    @app.get(FILES_PATH + "/{file_id}")
    async def get_file(raw: Request, file_id: str) -> Response:
        return await answer(raw, "get_file", file_id)

    @app.get(FILES_PATH + "/{file_id}/content")
    async def file_content(raw: Request, file_id: str) -> Response:
        return await answer(raw, "file_content", file_id)

    @app.delete(FILES_PATH + "/{file_id}")
    async def delete_file(raw: Request, file_id: str) -> Response:
        return await answer(raw, "delete_file", file_id)

    @app.post("/v1/batches")
    async def create_batch(raw: Request) -> Response:
        body = parse_body(await read_body(raw, max_body_bytes)) if batches is not None else None
        return await answer(raw, "create_batch", _api_key(raw), body)

    @app.get("/v1/batches")
    async def list_batches(raw: Request, after: str | None = None, limit: str = "20") -> Response:
        if not limit.isdigit():
            raise APIError(f"limit {limit!r} is no whole number", param="limit")
        return await answer(raw, "list_batches", after, int(limit))

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(raw: Request, batch_id: str) -> Response:
        return await answer(raw, "get_batch", batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(raw: Request, batch_id: str) -> Response:
        return await answer(raw, "cancel_batch", batch_id)


def _api_key(raw: Request) -> str | None:
    """The caller's key, which the batch's requests are sent with (kept in the service's memory only)."""
    authorization = raw.headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[len("bearer "):].strip() or None
    return raw.headers.get("x-api-key")
