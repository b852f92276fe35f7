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
    cache_bytes: int = 2 * 2**30
    """Reference cache budget (per-image latents and encoded sets), device bytes."""
    prompt_cache_bytes: int = 256 * 2**20
    """Prompt-embedding cache budget, device bytes."""
    max_queue: int = 16
    """Requests waiting for the worker; one more gets 429 with Retry-After."""
    max_upload_bytes: int = 50 * 2**20
    """Largest request body (all files and fields together)."""
    max_references: int = 4
    max_pixels: int = MAX_PIXELS
    """Largest image (width x height) accepted, uploaded or generated: 4 MP."""
    max_steps: int = 50
    max_batch: int = 1
    """Images that queued requests of one shape and reference set may share a batch for; 1: no batching."""
    lora_bytes: int = 2**30
    """Device bytes of the adapter slots of the LoRAs requests name (`--lora-dir`, `--lora-named`)."""
    max_images: int = 10
    """Largest n (images per request), OpenAI's limit."""
    max_result_bytes: int = 256 * 2**20
    """Finished /v1/jobs results kept (their PNGs' base64 text); the oldest leave first."""
    result_ttl: float = 3600.0
    """Seconds a finished /v1/jobs result is kept."""
    job_timeout: float = 1800.0
    """Seconds a job may run; past it, it stops at its next denoising step (504)."""
    max_event_streams: int = 64
    """Open GET /v1/jobs/{id}/events streams; one more gets 429 with Retry-After."""
    limit_concurrency: int = 256
    """Connections and tasks uvicorn serves at once; more get 503."""
    keep_alive_timeout: float = 5.0
    """Seconds uvicorn keeps an idle connection open."""
    access: Access = Access()
    """API keys and their limits, the bound host, the Host names and web origins allowed
    (`klein.serve.security`)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "access" and (not isinstance(value, int | float) or value <= 0):
                flag = "--" + field.name.replace("_", "-")
                raise InputError(f"{flag} must be a positive number, got {value!r}")
