"""The one JSON reader for checkpoint files: a missing or unreadable file is a `CheckpointError` naming it."""

from __future__ import annotations

import json
from pathlib import Path

from klein.errors import CheckpointError


def read_json(path: str | Path, what: str) -> dict:
    """The object in `path`; `what` says what the file is ("the VAE config") for the error message."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: cannot read {what} (no such file)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: cannot read {what} (nested too deep to be one)") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(value).__name__}")
    return value
