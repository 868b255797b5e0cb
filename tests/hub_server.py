"""A stand-in for the Hugging Face Hub on loopback: the four routes ``huggingface_hub.snapshot_download`` calls
(revision info, file tree, and HEAD/GET of each file), for one repository, recording what was fetched."""

from __future__ import annotations

import hashlib

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

# The one revision the stand-in serves (a commit hash, as the Hub names revisions).
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_app(repo_id: str, files: dict[str, bytes], fetched: list[str],
            asked: list[tuple[str, str | None]] | None = None):
    """An ASGI app serving ``files`` as ``repo_id``'s main revision, under any revision name; each file GET is
    appended to ``fetched``, and each revision lookup to ``asked`` as (revision, Authorization header)."""

    def etag(name: str) -> str:
        return f'"{hashlib.sha1(files[name]).hexdigest()}"'

    async def revision(request: Request) -> JSONResponse:
        if asked is not None:
            asked.append((request.path_params["revision"], request.headers.get("authorization")))
        return JSONResponse({"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": name} for name in files]})

    async def tree(_: Request) -> JSONResponse:
        return JSONResponse([{"type": "file", "path": name, "size": len(body), "oid": etag(name).strip('"')}
                             for name, body in files.items()])

    async def resolve(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in files:
            return Response(status_code=404)
        headers = {"X-Repo-Commit": COMMIT, "ETag": etag(name), "Content-Length": str(len(files[name]))}
        if request.method == "HEAD":
            return Response(headers=headers)
        fetched.append(name)
        return Response(files[name], headers=headers)

    return Starlette(routes=[Route(f"/api/models/{repo_id}/revision/{{revision}}", revision),
                             Route(f"/api/models/{repo_id}/tree/{{revision}}", tree),
                             Route(f"/{repo_id}/resolve/{{revision}}/{{name}}", resolve, methods=["GET", "HEAD"])])
