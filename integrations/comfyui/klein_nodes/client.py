"""A `klein serve` over HTTP, with the standard library only: JSON requests, multipart uploads and a job's
event stream (docs/serving.md). Every failure is a `KleinError` whose message is klein's own (its JSON
error's `message`), which ComfyUI shows as the node's error."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator

TIMEOUT = 900.0
"""Seconds to wait for any one read: a first request on a big model may compile for minutes."""


class KleinError(Exception):
    """klein's answer to a request that failed: `message` as the server wrote it, `code` its error code
    (e.g. "unknown_reference"), `status` the HTTP status (0: no answer)."""

    def __init__(self, message: str, code: str | None = None, status: int = 0):
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


class Client:
    def __init__(self, url: str, api_key: str = ""):
        self.url = url.strip().rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise KleinError(f"the server URL must start with http:// or https://, got {url!r:.100}")
        self.api_key = api_key.strip() or os.environ.get("KLEIN_API_KEY", "")

    def post_json(self, path: str, body: dict) -> dict:
        return self._json("POST", path, json.dumps(body).encode(), "application/json")

    def post_files(self, path: str, fields: dict[str, str], files: list[tuple[str, bytes]]) -> dict:
        """A multipart/form-data POST: text `fields`, and `files` as (field name, PNG bytes)."""
        boundary = uuid.uuid4().hex
        parts = []
        for name, value in fields.items():
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode())
            parts.append(value.encode() + b"\r\n")
        for i, (name, data) in enumerate(files):
            head = (
                f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{i}.png"\r\n'
                "Content-Type: image/png\r\n\r\n"
            )
            parts += [head.encode(), data, b"\r\n"]
        parts.append(f"--{boundary}--\r\n".encode())
        return self._json("POST", path, b"".join(parts), f"multipart/form-data; boundary={boundary}")

    def delete(self, path: str) -> None:
        try:
            self._json("DELETE", path, None, None)
        except KleinError:
            pass

    def events(self, path: str) -> Iterator[tuple[str, dict]]:
        """A server-sent event stream as (event name, data) pairs, until the server ends it."""
        with self._open("GET", path, None, None) as response:
            name = None
            for raw in response:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    yield name, json.loads(line.removeprefix("data: "))

    def run_job(
        self, body: dict, on_step: Callable[[int, int], None], interrupted: Callable[[], bool]
    ) -> dict:
        """POST /v1/jobs, then its events: `on_step(step, steps)` after each denoising step; the result of
        "done", or klein's error raised. When `interrupted()` turns true the job is cancelled
        (DELETE /v1/jobs/ID) and `InterruptedError` raised."""
        job = self.post_json("/v1/jobs", body)["id"]
        for name, data in self.events(f"/v1/jobs/{job}/events"):
            if interrupted():
                self.delete(f"/v1/jobs/{job}")
                raise InterruptedError(f"klein job {job} cancelled")
            if name == "step":
                on_step(data["step"], data["steps"])
            elif name == "done":
                return data
            elif name in ("error", "cancelled"):
                raise KleinError(data.get("message", name), data.get("code"))
        raise KleinError(f"klein serve ended job {job}'s event stream without a result")

    def _json(self, method: str, path: str, data: bytes | None, content_type: str | None) -> dict:
        with self._open(method, path, data, content_type) as response:
            return json.loads(response.read())

    def _open(self, method: str, path: str, data: bytes | None, content_type: str | None):
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if content_type:
            request.add_header("Content-Type", content_type)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(request, timeout=TIMEOUT)
        except urllib.error.HTTPError as error:
            raise answered(error.code, error.read()) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise KleinError(f"cannot reach klein serve at {self.url}: {reason}") from None


def answered(status: int, body: bytes) -> KleinError:
    """klein's JSON error ({"error": {"message", "code", ...}}, OpenAI's shape) as a `KleinError`; another
    server's answer is named by its status and first bytes."""
    try:
        error = json.loads(body)["error"]
        return KleinError(error["message"], error.get("code"), status)
    except (ValueError, KeyError, TypeError):
        text = body[:200].decode(errors="replace")
        return KleinError(f"HTTP {status} from the server, not klein's JSON error: {text}", None, status)
