"""A front that dies while it holds a request leaves Serve's HTTP proxy to answer a plain-text 500; this
middleware of the proxy makes it klein's JSON 503 with Retry-After (klein's own answers are JSON)."""

from __future__ import annotations

from starlette.middleware import Middleware

from klein.serve.errors import retry

RETRY_AFTER = 5
"""Seconds: Serve starts a new front at once; it answers once the replicas' config is read again."""
IMPORT_PATH = f"{__name__}.middlewares"


def middlewares() -> list[Middleware]:
    """Serve's proxy callback: the middlewares its HTTP proxy wraps every request in."""
    return [Middleware(FrontLost)]


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
                kind = dict(message.get("headers", ())).get(b"content-type", b"").decode("latin-1")
                if message["status"] == 500 and not kind.startswith("application/json"):
                    state["replaced"] = True
                    return
                state["started"] = True
            elif state["replaced"]:
                return  # the proxy's "Internal Server Error" body
            await send(message)

        await self.app(scope, receive, watched)
        if not state["started"]:
            lost = retry(
                503,
                f"the front of klein serve stopped while it held this request (Serve restarts it); its jobs "
                f"and uploads are gone: retry in {RETRY_AFTER} s",
                "front_lost",
                RETRY_AFTER,
            )
            await lost.response()(scope, receive, send)
