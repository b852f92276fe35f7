"""What Serve's HTTP proxy adds in front of the front: klein's error for a request the front dropped.

The front is one Serve replica; if its process dies while it holds a request (killed, out of memory, a
node lost), Serve's proxy answers that request itself with a plain-text 500 "Internal Server Error", and
Serve's controller starts a new front. That answer is neither klein's JSON error shape nor a status that
tells a client to retry: this ASGI middleware, installed in the proxy through Serve's proxy callback
(`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, set by `klein.serve.replicas.cluster`), turns it into
klein's 503 with Retry-After (`front_lost`). Every answer of klein's own app is JSON (errors included),
so nothing else matches: only the proxy's own plain-text 500s are replaced.
"""

from __future__ import annotations

from starlette.middleware import Middleware

from klein.serve.errors import ApiError, retry

RETRY_AFTER = 5
"""Seconds: Serve starts a new front at once; it answers once the replicas' config is read again."""
IMPORT_PATH = f"{__name__}.middlewares"


def middlewares() -> list[Middleware]:
    """Serve's proxy callback: the middlewares its HTTP proxy wraps every request in."""
    return [Middleware(FrontLost)]


def front_lost() -> ApiError:
    return retry(
        503,
        f"the front of klein serve stopped while it held this request (Serve restarts it); its jobs and "
        f"uploads are gone: retry in {RETRY_AFTER} s",
        "front_lost",
        RETRY_AFTER,
    )


class FrontLost:
    """Pure ASGI: a plain-text 500 from the proxy (or no answer at all) becomes klein's 503."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "replaced": False}

        async def watched(message):
            if message["type"] == "http.response.start":
                if _proxy_error(message):
                    state["replaced"] = True
                    return
                state["started"] = True
            elif state["replaced"]:
                return  # the proxy's "Internal Server Error" body
            await send(message)

        await self.app(scope, receive, watched)
        if not state["started"]:
            await front_lost().response()(scope, receive, send)


def _proxy_error(start: dict) -> bool:
    headers = dict(start.get("headers", ()))
    kind = headers.get(b"content-type", b"").decode("latin-1")
    return start["status"] == 500 and not kind.startswith("application/json")
