"""Where a pipeline's load (and first call) spends its time, by phase: reading tensors from the files,
checking them finite, preparing them on the host (transposes and casts: `klein.io.loading._read`),
quantising on the host, preparing on the device (`klein.io.device_loading`), `jax.device_put`, and jax's
own tracing, lowering, compiling and compilation-cache reads (from `jax.monitoring`).

Each phase is the time spent inside its functions, less the time in the other phases they call (a
`_read` that calls `TensorSource.get` counts only its own transposes); with threads reading ahead, phases
add up to more than the wall time. Used by `benchmarks/tpu/tpu_v5e.py`:

    with load_phases.timed() as phases:
        pipe = load_pipeline(...)
    print(phases.seconds())
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time

import jax

from klein.io import device_loading, finite, loading
from klein.io import safetensors as safetensors_io
from klein.models import products

# (module or class, attribute, phase)
PATCHED = (
    (safetensors_io.TensorSource, "get", "read"),
    (finite, "checked", "finite check"),
    (loading, "_read", "host transpose and cast"),
    (products, "quantise", "host quantise"),
    (products, "scales_of", "host quantise"),
    (device_loading, "_prepared", "device transpose and quantise (dispatch)"),
    (jax, "device_put", "device_put"),
)
# jax.monitoring's duration events -> phases
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "jax: trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "jax: lower",
    "/jax/core/compile/backend_compile_duration": "jax: compile (or cache read)",
    "/jax/compilation_cache/cache_retrieval_time_sec": "jax: cache read",
    "/jax/compilation_cache/compile_time_saved_sec": "jax: compile time saved by the cache",
}
COUNTED = {
    "/jax/compilation_cache/cache_hits": "jax: cache hits",
    "/jax/compilation_cache/cache_misses": "jax: cache misses",
}


class Phases:
    def __init__(self):
        self._seconds: dict[str, float] = collections.defaultdict(float)
        self._calls: dict[str, int] = collections.defaultdict(int)
        self._lock = threading.Lock()
        self._local = threading.local()

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return {phase: round(seconds, 2) for phase, seconds in sorted(self._seconds.items())}

    def calls(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._calls.items()))

    def count(self, event: str) -> None:
        """One more `event` (no time: seen in `calls` alone)."""
        with self._lock:
            self._calls[event] += 1

    def add(self, phase: str, seconds: float, calls: int = 1) -> None:
        with self._lock:
            self._seconds[phase] += seconds
            self._calls[phase] += calls

    def wrap(self, function, phase: str):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # time spent in nested phases
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                nested = stack.pop()
                if stack:
                    stack[-1] += spent
                self.add(phase, spent - nested)

        return timed


@contextlib.contextmanager
def timed():
    """The `Phases` of what runs inside, its functions patched for as long."""
    phases = Phases()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PATCHED]
    for owner, name, phase in PATCHED:
        setattr(owner, name, phases.wrap(getattr(owner, name), phase))

    def heard(event: str, seconds: float, **_) -> None:
        if event in EVENTS:
            phases.add(EVENTS[event], seconds)

    def counted(event: str, **_) -> None:
        if event in COUNTED:
            phases.count(COUNTED[event])

    jax.monitoring.register_event_duration_secs_listener(heard)
    jax.monitoring.register_event_listener(counted)
    try:
        yield phases
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        jax.monitoring.unregister_event_duration_listener(heard)
        jax.monitoring.unregister_event_listener(counted)
