"""Counting the programs jax builds, for the zero-recompile test, the warm-up log, the compile benchmark and a
server's metrics: a program counts when jax lowers it (a miss of the jitted function's in-memory cache),
whether XLA then compiles it or reads it back from the persistent cache.
"""

from __future__ import annotations

import threading
from collections import Counter

import jax.monitoring

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
"""jax's event for every program lowered to MLIR (`jax._src.dispatch.JAXPR_TO_MLIR_MODULE_EVENT`)."""


class Compilations:
    """`with Compilations() as built:` ... `built.names`: the functions whose programs were built inside,
    in order, one entry a program; `built.seconds`: the time spent lowering them. Only this thread's: a
    program another thread builds meanwhile (a server's background compiles) is not this thread's wait."""

    def __init__(self):
        self.names: list[str] = []
        self.seconds = 0.0
        self._thread = threading.get_ident()

    def _heard(self, event: str, duration: float, **kwargs) -> None:
        if event == LOWERED and threading.get_ident() == self._thread:
            self.names.append(kwargs.get("fun_name", "?"))
            self.seconds += duration

    def __enter__(self) -> Compilations:
        jax.monitoring.register_event_duration_secs_listener(self._heard)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._heard)

    def __len__(self) -> int:
        return len(self.names)


BUILT: Counter[str] = Counter()
"""Programs this process has built since klein was imported, by the name of the function jitted (the
pipeline's are named after their stage: `step`, `prefill`, `decode_latents`, ...)."""
BUILT_BEHIND: Counter[str] = Counter()
"""Those of `BUILT` built by a thread marked `behind()` (`klein.pipeline.warm_buckets`' background compiles)."""
_marked = threading.local()


def behind() -> None:
    """Mark this thread as one that compiles behind the requests: its programs count in `BUILT_BEHIND` too."""
    _marked.behind = True


def _count(event: str, duration: float, **kwargs) -> None:
    if event == LOWERED:
        name = kwargs.get("fun_name", "?")
        name = name[4:-1] if name.startswith("jit(") else name
        BUILT[name] += 1
        if getattr(_marked, "behind", False):
            BUILT_BEHIND[name] += 1


jax.monitoring.register_event_duration_secs_listener(_count)
