"""What every HTTP request of `klein serve` passes before a route sees it: Host, Origin, CORS preflight, the
API key and its rate, the body cap, the queue and the body budget (`intake`); every response counted for
/metrics."""

from __future__ import annotations

import time

from fastapi.responses import Response
from starlette.datastructures import Headers

from klein.serve import body_cap
from klein.serve.errors import ApiError
from klein.serve.intake import Intake
from klein.serve.quotas import Quotas
from klein.serve.security import STATE_CHANGING, Access

# No data in these, so no key needed (a browser sends none to open them); the API calls /docs makes need it.
PUBLIC = ("/healthz", "/", "/docs", "/openapi.json")
PUBLIC_PREFIX = "/static/"  # the web page's and the docs' files: no data, so no key needed
PREFLIGHT_SECONDS = 600
NOT_FRAMED = [(b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'")]
"""On every response: no other site may show the page (or /docs) in a frame, to trick clicks on it."""


class Guard:
    """Pure ASGI middleware over the app; `service` gives the options and the metrics."""

    def __init__(self, app, service, quotas: Quotas):
        self.app, self.service, self.quotas = app, service, quotas
        self.access: Access = service.options.access
        self.intake = Intake(service, quotas)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics, started, status = self.service.metrics, time.perf_counter(), []
        headers = Headers(scope=scope)
        cors = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in self.access.cors(headers.get("origin")).items()
        ]

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(_label(scope["path"], message["status"]))
                message["headers"] = [*message.get("headers", []), *cors, *NOT_FRAMED]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                metrics.count_request(status[0], time.perf_counter() - started)

        try:
            answer = self._admit(scope, headers)
        except ApiError as error:
            answer = error.response()
        if answer is not None:
            return await answer(scope, receive, counted)
        allowed, what = body_cap.limit(headers, self.service.options.max_upload_bytes)
        if headers.get("content-length", "").isdigit() and int(headers["content-length"]) > allowed:
            return await body_cap.TooLarge(allowed, what).error.response()(scope, receive, counted)
        try:
            release = self.intake.admit(scope, headers, allowed)
        except ApiError as error:
            return await error.response()(scope, receive, counted)
        try:
            return await self.app(scope, body_cap.capped(receive, allowed, what), counted)
        finally:
            release()

    def _admit(self, scope, headers: Headers) -> Response | None:
        """None to let the request through; a response (a preflight's), or an `ApiError`, to stop it."""
        access, method, origin = self.access, scope["method"], headers.get("origin")
        if not access.keys and not access.host_allowed(headers.get("host")):
            raise ApiError(
                403,
                f"Host {headers.get('host')!r:.80} is not this server's name: to reach it by that name, "
                "start it with --allowed-hosts NAME (or with an API key)",
                "forbidden_host",
            )
        if (
            origin is not None
            and method in STATE_CHANGING
            and not access.origin_allowed(origin, headers.get("host"))
        ):
            raise ApiError(
                403,
                f"requests from the web page at {origin!r:.80} are refused: start the server with "
                "--allowed-origins ORIGIN to let that site call it",
                "forbidden_origin",
            )
        if method == "OPTIONS" and access.cors(origin) and "access-control-request-method" in headers:
            # Its Allow-Origin added with every answer's CORS headers.
            allowed = {
                "Access-Control-Allow-Methods": "GET, POST, DELETE",
                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                "Access-Control-Max-Age": str(PREFLIGHT_SECONDS),
            }
            return Response(status_code=204, headers=allowed)
        path = scope["path"]
        if not access.keys or path in PUBLIC or path.startswith(PUBLIC_PREFIX):
            return None
        key = access.match(headers.get("authorization", ""))
        if key is None:
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY'",
                "unauthorized",
                headers={"WWW-Authenticate": "Bearer"},
            )
        self.quotas.request(key)
        scope.setdefault("state", {})["api_key"] = key
        return None


def _label(path: str, status: int) -> str:
    """A response's status as klein_requests_total counts it: /healthz's 503 while compiling ahead is
    "warming" (a probe asked early, not an error)."""
    return "warming" if path == "/healthz" and status == 503 else str(status)
