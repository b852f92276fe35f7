"""Every request body capped while it streams: 413 beyond the cap, from its Content-Length or as soon as
the bytes read pass it, never read whole first."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from klein.serve.errors import ApiError

MAX_JSON_BYTES = 2**20


class TooLarge(HTTPException):
    """Raised by the capped `receive`: an `HTTPException`, so that FastAPI's body reading passes it on
    instead of calling it a parse error; the app answers `error`."""

    def __init__(self, limit: int, what: str):
        super().__init__(413)
        self.error = ApiError(
            413, f"the request body is larger than the {limit} bytes allowed ({what})", "upload_too_large"
        )


def limit(headers: Headers, max_upload_bytes: int) -> tuple[int, str]:
    """(bytes allowed, what allows them) for a request's body."""
    multipart = headers.get("content-type", "").lower().startswith("multipart/")
    if multipart or MAX_JSON_BYTES >= max_upload_bytes:
        return max_upload_bytes, "--max-upload-bytes"
    return MAX_JSON_BYTES, "a body that is not multipart"


def capped(receive, allowed: int, what: str):
    """`receive` that raises `TooLarge` once the body read so far passes `allowed` bytes."""
    seen = 0

    async def read():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > allowed:
            raise TooLarge(allowed, what)
        return message

    return read
