"""The front's job ids across its restarts: each front issues ids under a token of its own, so that an id
an earlier front issued is answered "the front restarted" (404 `front_restarted`), not "unknown"."""

from __future__ import annotations

import re
import secrets
import time
import uuid

from klein.serve.errors import ApiError
from klein.serve.jobs import JobTable

_ISSUED = re.compile(r"([0-9a-f]{8})-[0-9a-f]{32}")
"""A front's job id: the issuing process's token, then a random id."""


class FrontJobTable(JobTable):
    def __init__(self, budget: int, ttl: float):
        super().__init__(budget, ttl)
        self.token = secrets.token_hex(4)
        self.started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    def new_id(self) -> str:
        return f"{self.token}-{uuid.uuid4().hex}"

    def get(self, job_id: str, owner: str | None = None):
        try:
            return super().get(job_id, owner)
        except ApiError as error:
            issued = _ISSUED.fullmatch(job_id)
            if error.code == "unknown_job" and issued and issued.group(1) != self.token:
                raise ApiError(
                    404,
                    f"job {job_id} was accepted by an earlier front of this server, which stopped; the "
                    f"front restarted at {self.started} without its jobs and uploads: submit it again",
                    "front_restarted",
                    "id",
                ) from None
            raise
