"""Peak resident memory of this process over a block of code: on Linux the high-water mark is reset for
each run (/proc/self/clear_refs), elsewhere the lifetime peak (ru_maxrss) is the best available. Both
engines live in one process, so the growth over the RSS at the start is what the run itself needed.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

from klein.memory.process import proc_bytes

_STATUS = "/proc/self/status"
_CLEAR_REFS = Path("/proc/self/clear_refs")


class PeakRSS:
    """`with PeakRSS() as m: ...` then `m.start` and `m.peak` in bytes."""

    def __enter__(self) -> PeakRSS:
        try:
            _CLEAR_REFS.write_text("5")
            self._reset = True
        except OSError:
            self._reset = False
        self.start = proc_bytes(_STATUS, "VmRSS") or 0
        return self

    def __exit__(self, *exc) -> None:
        hwm = proc_bytes(_STATUS, "VmHWM") if self._reset else None
        if hwm is not None:
            self.peak = hwm
        else:
            # ru_maxrss is in kB on Linux, in bytes on macOS.
            scale = 1 if sys.platform == "darwin" else 1024
            self.peak = scale * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
