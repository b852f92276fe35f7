"""What `klein serve` is told: limits and budgets (defaults as BFL's API where it has one), and SIZE text shown back
(`show_size`; read by `klein.request.kinds.parse_size`)."""

from __future__ import annotations

import dataclasses

from klein.errors import InputError
from klein.request.kinds import UNITS
from klein.request.resolve import MAX_PIXELS
from klein.serve.security import Access


def show_size(value: int) -> str:
    """Bytes as `parse_size` reads them back, in the largest binary unit that divides them: 2GiB, 256MiB."""
    for unit in ("GiB", "MiB", "KiB"):
        if value and value % UNITS[unit.lower()] == 0:
            return f"{value // UNITS[unit.lower()]}{unit}"
    return str(value)


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What `klein serve` is told; each field is the flag of its name, described by `klein.cli.serve`
    (limits in bytes, seconds or counts, each positive), and `access`: `klein.serve.security.Access`."""

    cache_bytes: int = 2 * 2**30
    prompt_cache_bytes: int = 256 * 2**20
    max_queue: int = 16
    max_upload_bytes: int = 50 * 2**20
    max_references: int = 4
    max_pixels: int = MAX_PIXELS
    max_steps: int = 50
    max_batch: int = 1
    lora_bytes: int = 2**30
    max_images: int = 10
    """Largest n (images per request), OpenAI's limit (no flag)."""
    max_result_bytes: int = 256 * 2**20
    result_ttl: float = 3600.0
    job_timeout: float = 1800.0
    max_event_streams: int = 64
    limit_concurrency: int = 256
    max_unauthenticated: int = 64
    keep_alive_timeout: float = 5.0
    header_timeout: float = 10.0
    min_body_rate: int = 4 * 2**10
    """Bytes a second."""
    upload_budget_bytes: int = 512 * 2**20
    shutdown_grace: float = 20.0
    access: Access = Access()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "access" and (not isinstance(value, int | float) or value <= 0):
                flag = "--" + field.name.replace("_", "-")
                raise InputError(f"{flag} must be a positive number, got {value!r}")
        if self.upload_budget_bytes < self.max_upload_bytes:
            raise InputError(
                f"--upload-budget-bytes ({show_size(self.upload_budget_bytes)}) must be at least "
                f"--max-upload-bytes ({show_size(self.max_upload_bytes)}): a body that large could never be read"
            )
