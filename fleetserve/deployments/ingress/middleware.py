"""The checks around every HTTP request to the ingress, as one pure ASGI middleware: the request count,
authentication and the body-size limit.

Starlette's ``@app.middleware("http")`` (``BaseHTTPMiddleware``) relays every chunk of a streamed response
through a memory stream and a task switch per middleware. Three of them cost about an eighth of the
ingress's CPU per streamed token (py-spy on ``benchmarks/front_door_ceiling.py``); here a chunk costs one
function call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.deployments.ingress.streaming import error_response


class FrontDoorMiddleware:
    """Counts forwarded requests by route, model and status; authenticates; refuses oversized bodies.

    In that order, outermost first: a 401 or an oversized body, refused before routing, is counted too,
    and a caller without a key learns nothing but that (as OpenAI does), whatever its body.

    Args:
        app: the app to wrap.
        authenticate: the caller's principal from the request's Authorization header, else its x-api-key
            header as Anthropic's SDKs send it (raises APIError 401),
            or None when auth is off; it is stored as ``request.state.principal``.
        open_paths: path suffixes served without a key.
        max_body_bytes: the body-size limit in bytes of a request to a path, read per request.
        count: called once per response with (route, model, status) for requests on ``counted_routes``;
            the model is what the endpoint stored as ``request.state.model``, or "unknown".
        counted_routes: the route templates to count.
    """

    def __init__(self, app: ASGIApp, authenticate: Callable[[str | None], Any] | None, open_paths: tuple[str, ...],
                 max_body_bytes: Callable[[str], int], count: Callable[[str, str, int], None],
                 counted_routes: tuple[str, ...]) -> None:
        self.app = app
        self.authenticate = authenticate
        self.open_paths = open_paths
        self.max_body_bytes = max_body_bytes
        self.count = count
        self.counted_routes = counted_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted_send = self._counting(scope, send)
        try:
            self._check(scope)
        except APIError as error:
            await error_response(error, path=scope["path"])(scope, receive, counted_send)
            return
        await self.app(scope, receive, counted_send)

    def _check(self, scope: Scope) -> None:
        """Raises the APIError that refuses the request before routing, if any."""
        headers = dict(scope["headers"])
        if self.authenticate is not None and not scope["path"].endswith(self.open_paths):
            authorization = headers.get(b"authorization")
            if authorization is None and headers.get(b"x-api-key"):
                # How Anthropic's SDKs send a key (for /v1/messages): the same key, the same checks.
                authorization = b"Bearer " + headers[b"x-api-key"]
            principal = self.authenticate(authorization.decode("latin-1") if authorization is not None else None)
            scope.setdefault("state", {})["principal"] = principal
        length = headers.get(b"content-length")
        limit = self.max_body_bytes(scope["path"])
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(f"request body is {int(length)} bytes; the limit is {limit}", 400,
                           code="request_too_large")

    def _counting(self, scope: Scope, send: Send) -> Send:
        """``send``, counting the request when its response starts."""
        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._count(scope, message["status"])
            await send(message)

        return counted_send

    def _count(self, scope: Scope, status: int) -> None:
        # The matched route's template, not the URL: under a Serve route prefix the URL carries it too.
        # A request refused before routing has none: its path's counted route, then.
        route = getattr(scope.get("route"), "path", None) or next(
            (path for path in self.counted_routes if scope["path"].endswith(path)), None)
        if route in self.counted_routes:
            self.count(route, scope.get("state", {}).get("model") or "unknown", status)
