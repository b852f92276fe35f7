"""HTTP errors in OpenAI's shape, which the official client parses; `from_input_error` maps klein's own
`InputError`s onto a status and code."""

from __future__ import annotations

from starlette.responses import JSONResponse

from klein.errors import HTTP, CannotFitError, InputError, WordedError, worded


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)

    def fields(self) -> dict:
        """As plain data, `ApiError(**fields)` again: a replica's refusal crosses to the front so."""
        return {name: getattr(self, name) for name in ("status", "message", "code", "param", "headers")}


def retry(status: int, message: str, code: str, seconds: int) -> ApiError:
    """A refusal that says when to try again (`Retry-After`)."""
    return ApiError(status, message, code, headers={"Retry-After": str(seconds)})


def client_closed() -> ApiError:
    return ApiError(499, "the client went away", "client_closed")


def from_input_error(error: InputError) -> ApiError:
    from klein.serve.reference_sets import UnknownReferences

    if isinstance(error, CannotFitError):
        return ApiError(422, str(error), "cannot_fit")
    if isinstance(error, UnknownReferences):
        return ApiError(404, str(error), "unknown_reference", "references")
    if isinstance(error, WordedError):
        return ApiError(400, worded(error, HTTP), "invalid_value", error.field)
    return ApiError(400, str(error), "invalid_request")


def weights_refused() -> ApiError:
    """The server's own weights could not be read for a request (a model a residency policy reads when a
    request needs it, refused: `klein.io.finite`); the log names the file, the client is told no path."""
    return ApiError(
        503,
        "the server cannot load its model's weights (its log names the file and why); the operator must "
        "replace the file",
        "weights_refused",
    )


def internal(error: Exception) -> ApiError:
    return ApiError(
        500, f"internal error: {type(error).__name__}; the server logged the traceback", "internal"
    )
