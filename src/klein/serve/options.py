"""What `klein serve` is told: limits and budgets (defaults as BFL's API where it has one), and SIZE text."""

from __future__ import annotations

import dataclasses
import re

from klein.errors import InputError
from klein.serve.security import Access

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20}
_UNITS |= {"g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_size(text: str) -> int:
    """ "4096", "512KiB", "64 MiB", "2GiB" -> bytes (binary units; KB and MB mean KiB and MiB here)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise InputError(f"{text!r} is not a size; give bytes or KiB/MiB/GiB, e.g. 512MiB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def show_size(value: int) -> str:
    """Bytes as `parse_size` reads them back, in the largest binary unit that divides them: 2GiB, 256MiB."""
    for unit in ("GiB", "MiB", "KiB"):
        if value and value % _UNITS[unit.lower()] == 0:
            return f"{value // _UNITS[unit.lower()]}{unit}"
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
    max_pixels: int = 4 * 2**20
    """Largest image (width x height) accepted, uploaded or generated: 4 MP."""
    max_steps: int = 50
    max_batch: int = 1
    lora_bytes: int = 2**30
    """Device bytes of the adapter slots of the LoRAs requests name (`--lora-dir`, `--lora-named`)."""
    """Images that queued requests of one shape and reference set may share a batch for; 1: no batching."""
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
