"""Wall time per pipeline stage, with XLA compilation booked apart.

JAX reports every backend compilation through `jax.monitoring`; a stage's compile time is moved from the
stage to "compile", so a first call's breakdown says what compiling cost and what running cost.
"""

import time
from collections import Counter

import jax

_compile_seconds = [0.0]  # XLA compilation time so far in this process


def _on_duration(event: str, seconds: float, **_kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_seconds[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


class StageClock:
    """Wall time per stage, with XLA compilation inside a stage booked under "compile" instead."""

    def __init__(self, timings):
        self.timings = timings

    def __call__(self, stage):
        return _Timed(self.timings, stage)


class _Timed:
    def __init__(self, timings, stage):
        self.timings, self.stage = timings, stage

    def __enter__(self):
        self.start, self.compiled = time.perf_counter(), _compile_seconds[0]

    def __exit__(self, *exc):
        compiling = _compile_seconds[0] - self.compiled
        elapsed = time.perf_counter() - self.start
        for stage, seconds in ((self.stage, elapsed - compiling), ("compile", compiling)):
            self.timings[stage] = self.timings.get(stage, 0.0) + seconds


class Stages:
    """The one stage helper of the pipeline: `run(stage, fn, *args)` times the stage (compilation apart),
    waits for its device work to finish (dispatch is asynchronous) so that each stage's time is its own,
    and counts it in `counters` (work actually done: lets tests prove reuse)."""

    def __init__(self, counters: Counter, timings: dict[str, float], on_done=None):
        self.counters, self.timings = counters, timings
        self._clock = StageClock(timings)
        self._on_done = on_done
        """None, or `on_done(stage)` after each stage (the Python API's progress bar)."""

    def run(self, stage: str, fn, *args):
        with self._clock(stage):
            out = jax.block_until_ready(fn(*args))
        self.counters[stage] += 1
        if self._on_done:
            self._on_done(stage)
        return out
