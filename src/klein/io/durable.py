"""Writes that survive a crash or a power cut: a file's bytes reach the disk (fsync) before it is renamed
into place, and the rename itself is made durable by syncing its folder. Without the first, a crash just
after a rename can leave a whole-looking name over empty or partial contents (ext4's delayed allocation).
"""

from __future__ import annotations

import os
from pathlib import Path


def flush(stream) -> None:
    """Push everything written to `stream` (an open file) through to the disk."""
    stream.flush()
    os.fsync(stream.fileno())


def sync_folder(folder: Path) -> None:
    """Make the renames and links done in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
