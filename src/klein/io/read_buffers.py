"""Reading tensors into host buffers that are used again, rather than into new arrays.

On a TPU host under a sandboxed kernel (gVisor) the pages of a new array cost more to fault in than the read
itself: `np.fromfile` of a checkpoint's tensors ran at about 1 GiB/s, reads into a buffer already in memory
at 4.7 GiB/s (`benchmarks/checkpoints/host_reads.py`). `klein.io.device_loading` reads each large weight into a buffer of
a `Pool`, sends it to the device and waits for the transfer, then gives the buffer back for the next.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import numpy as np

_next = threading.local()  # .buffer: the uint8 buffer the next read on this thread fills, if any


class Pool:
    """Host buffers, each taken by one reader at a time (`taken`), kept for the next."""

    def __init__(self):
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def taken(self):
        """Within: the next tensor this thread reads (`klein.io.safetensors.read_rows`) fills a buffer of
        the pool, grown to its size if need be; its array is valid until the block ends."""
        with self._lock:
            buffer = self._free.pop() if self._free else np.empty(0, np.uint8)
        holder = [buffer]
        _next.buffer = holder
        try:
            yield
        finally:
            _next.buffer = None
            with self._lock:
                self._free.append(holder[0])


def read(path: Path, dtype: np.dtype, count: int, offset: int) -> np.ndarray | None:
    """`count` values of `dtype` at `offset` in `path`, read into this thread's taken buffer (the first read
    of a `Pool.taken` block only); None where no buffer was taken (read as usual then)."""
    holder = getattr(_next, "buffer", None)
    nbytes = count * dtype.itemsize
    if holder is None or nbytes == 0:
        return None
    _next.buffer = None  # one read a buffer: a second tensor read in the block gets an array of its own
    if holder[0].size < nbytes:
        holder[0] = np.empty(nbytes, np.uint8)
    view = memoryview(holder[0])[:nbytes]
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < nbytes:
            got = os.preadv(f.fileno(), [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"the file ends {nbytes - done} bytes before the tensor does")
            done += got
    return np.frombuffer(holder[0], dtype, count)
