"""Writes that survive a crash or a power cut: a file's bytes reach the disk (fsync) before it is renamed
into place, and the rename itself is made durable by syncing its folder. The temporary files of the writes
under way are known here, so that a process told to stop at once (`klein.cli.interrupts`) removes them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

_temporaries: set[Path] = set()
"""The temporary files of the writes under way (`temporary`)."""


@contextlib.contextmanager
def temporary(path: Path) -> Iterator[Path]:
    """A fresh temporary name beside `path` (in its folder, so the rename into place stays on one
    filesystem), removed on leaving whatever happened, or by `remove_temporaries` on an exit at once."""
    name = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    _temporaries.add(name)
    try:
        yield name
    finally:
        name.unlink(missing_ok=True)
        _temporaries.discard(name)


def remove_temporaries() -> None:
    """Remove the temporary files of the writes under way (the process exits without finishing them)."""
    for name in list(_temporaries):
        name.unlink(missing_ok=True)


def flush(stream) -> None:
    """Push everything written to `stream` (an open file) through to the disk."""
    stream.flush()
    os.fsync(stream.fileno())


def sync_folder(folder: Path) -> None:
    """Make the renames and links done in `folder` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
