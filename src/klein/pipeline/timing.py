"""Wall time per pipeline stage, with XLA compilation (which jax reports through `jax.monitoring`) booked
apart under "compile", so a first call's breakdown says what compiling cost, and so are a residency
turn's transfers inside a stage ("offload", "onload": `book`); and each stage told as events
(`klein.pipeline.stage_events`).
"""

import threading
import time
from collections import Counter

import jax

from klein.pipeline.stage_events import StageEvent

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""jax's event around a backend compilation (or its load from the persistent cache)."""
_thread = threading.local()  # .compiled: XLA compilation time so far on this thread (a background compile
# of another thread is not this thread's wait); .on_compile: what the stage running here does when XLA compiles


def compiled_seconds() -> float:
    """Seconds this thread has spent in XLA compilation (or loading from the persistent cache)."""
    return getattr(_thread, "compiled", 0.0)


def _on_duration(event: str, seconds: float, **_kwargs) -> None:
    if event == COMPILE_EVENT:  # jax tells its listeners on the thread that compiled
        _thread.compiled = compiled_seconds() + seconds


def _on_start(event: str, _value: float, **_kwargs) -> None:
    # jax records the start time of a compilation as a scalar under the same name as its duration.
    on_compile = getattr(_thread, "on_compile", None)
    if event == COMPILE_EVENT and on_compile is not None:
        on_compile()


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_scalar_listener(_on_start)


def book(stage: str, seconds: float) -> None:
    """Book `seconds` of the stage running on this thread under `stage` instead of its own (a model moved
    on or off the device inside it); nothing where no stage runs."""
    timed = getattr(_thread, "timed", None)
    if timed is not None:
        timed.timings[stage] = timed.timings.get(stage, 0.0) + seconds
    while timed is not None:  # the stages around it too
        timed.apart, timed = timed.apart + seconds, timed._timed


class Timed:
    """`with Timed(timings, stage):` adds the stage's wall time to `timings[stage]`, XLA compilation inside
    it to `timings["compile"]`; `seconds` and `compiling` once it ends; `on_compile()` when its first
    compilation starts."""

    def __init__(self, timings, stage, on_compile=None):
        self.timings, self.stage, self.on_compile = timings, stage, on_compile
        self.seconds = self.compiling = 0.0

    def __enter__(self):
        self.start, self.compiled, self.apart = time.perf_counter(), compiled_seconds(), 0.0
        self._timed, _thread.timed = getattr(_thread, "timed", None), self
        self._outer = getattr(_thread, "on_compile", None)
        _thread.on_compile = self._compiles if self.on_compile else None
        return self

    def _compiles(self):
        _thread.on_compile = None  # once per stage
        self.on_compile()

    def __exit__(self, *exc):
        _thread.on_compile, _thread.timed = self._outer, self._timed
        self.compiling = compiled_seconds() - self.compiled
        self.seconds = time.perf_counter() - self.start - self.compiling - self.apart
        for stage, seconds in ((self.stage, self.seconds), ("compile", self.compiling)):
            self.timings[stage] = self.timings.get(stage, 0.0) + seconds


class Stages:
    """The one stage helper of the pipeline: `run(stage, fn, *args)` times the stage (compilation apart),
    waits for its device work to finish (dispatch is asynchronous) so that each stage's time is its own,
    counts it in `counters` (work actually done: lets tests prove reuse), and tells `progress` of it."""

    def __init__(self, counters: Counter, timings: dict[str, float], progress=None):
        self.counters, self.timings = counters, timings
        self._progress = progress
        """None, or `progress(StageEvent)` as each stage starts, starts compiling and ends."""

    def run(self, stage: str, fn, *args, total: int = 1):
        """`fn(*args)` as `stage`; `total`: the steps it reports (the denoising loop reports them itself)."""
        tell = self._progress
        on_compile = tell and (lambda: tell(StageEvent(stage, 0, total, compiling=True)))
        if tell:
            tell(StageEvent(stage, 0, total))
        with Timed(self.timings, stage, on_compile) as timed:
            out = jax.block_until_ready(fn(*args))
        self.counters[stage] += 1
        if tell:
            tell(StageEvent(stage, total, total, timed.seconds, timed.compiling))
        return out
