"""Warm buckets first (docs/design/compiling.md, "Warm buckets first"): a request whose transformer
programs were never built runs at once on the smallest built ones that hold it (more padding, masked as
any bucket's: the same image up to float rounding), while one thread compiles its own behind the requests;
later requests of that shape then run on them.

A shape is warm once its program exists in this process: run by a request (the warm-up's included) or
compiled behind. The choice is made per request, by `WarmBuckets.step` and `WarmBuckets.prefill`, and only
once `fallback` is on (`klein.pipeline.warmup.warm` turns it on: a warmed pipeline, and so `klein serve`);
otherwise every request runs its own buckets, compiling them in the foreground as before.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable

from klein.pipeline import compilations
from klein.request.modes import Mode

log = logging.getLogger("klein.warm_buckets")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What decides a denoising step's program: the mode, the batch (after a mesh's padding), the image's
    token stream, the references' (their cached keys' count under KV editing, 0 without references) and
    whether unmerged LoRAs run."""

    mode: Mode
    batch: int
    image: int
    references: int
    lora: bool

    def holds(self, other: StepShape, fixed_references: bool) -> bool:
        """Whether `other` can run on this shape's program, padded: as many rows (a batch no warm one
        equals runs in parts: `klein.pipeline.split_batch`), as many tokens or fewer in each stream; the
        references' exactly as many when they come as cached keys (their count is the program's, and
        padding them would be a program per count)."""
        references = (
            self.references == other.references if fixed_references else (self.references >= other.references)
        )
        same = (self.mode, self.lora) == (other.mode, other.lora)
        return same and references and self.batch == other.batch and self.image >= other.image

    @property
    def tokens(self) -> int:
        return self.batch * (self.image + self.references)


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    """What decides a prefill's program: the references' token stream, and whether unmerged LoRAs run."""

    references: int
    lora: bool

    def holds(self, other: PrefillShape, fixed_references: bool = False) -> bool:
        return self.lora == other.lora and self.references >= other.references

    @property
    def tokens(self) -> int:
        return self.references


@dataclasses.dataclass(frozen=True)
class CanvasShape:
    """What decides a VAE program on a canvas (`klein.models.vae_canvas`): encoding or decoding, the
    batch, the canvas's height and width in px (an image's own: its size's class, `vae_canvas.canvas_size`)."""

    kind: str
    batch: int
    height: int
    width: int

    def holds(self, other: CanvasShape, fixed_references: bool = False) -> bool:
        same = self.kind == other.kind and self.batch >= other.batch
        return same and self.height >= other.height and self.width >= other.width

    @property
    def tokens(self) -> int:
        return self.batch * self.height * self.width


@dataclasses.dataclass(frozen=True)
class NoiseShape:
    """The length of a draw of noise (`klein.pipeline.bucket_fit.noise`)."""

    length: int

    def holds(self, other: NoiseShape, fixed_references: bool = False) -> bool:
        return self.length >= other.length

    @property
    def tokens(self) -> int:
        return self.length


@dataclasses.dataclass(frozen=True)
class Fit:
    """The shape a request runs on (`used`) and its own (`tight`)."""

    tight: StepShape | PrefillShape
    used: StepShape | PrefillShape

    @property
    def larger(self) -> bool:
        """Whether it runs on a larger warm shape than its own."""
        return self.used != self.tight


class WarmBuckets:
    """The warm shapes of one pipeline's programs, the choice of one per request, and the thread that
    compiles the tight ones behind the requests."""

    def __init__(self, allowed: Callable[[], bool] = lambda: True):
        self.fallback = False
        """Run a request on a larger warm shape when its own is not warm (and compile its own behind)."""
        self.allowed = allowed
        """Whether compiling behind is safe now (read at each choice and compile): a program asks for its
        weights, which under a residency policy that moves them would move under the worker."""
        self.warm: set = set()
        """Shapes whose programs exist in this process."""
        self.pending: set = set()
        """Shapes queued or compiling behind the requests."""
        self.counts: Counter[str] = Counter()
        """"larger": requests run on a larger shape; "compiled": shapes compiled behind; "failed"."""
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def saw(self, fit: Fit | None) -> None:
        """`fit.used` ran: its program exists (None: a run over exact sizes, not tracked)."""
        if fit is None:
            return
        with self._lock:
            self.warm.add(fit.used)

    def fit(
        self, tight, fixed_references: bool = False, usable: Callable[[object], bool] | None = None
    ) -> Fit:
        """The shape a program of `tight` runs on: its own when warm (or without `fallback`), else the warm
        shape of fewest tokens (pixels, values) that holds it, else its own (compiled now). `usable(shape)`:
        whether a warm shape may be chosen (a prefill's, whether steps over its keys are warm too)."""
        usable = usable or (lambda shape: True)
        with self._lock:
            if not self.fallback or not self.allowed() or (tight in self.warm and usable(tight)):
                return Fit(tight, tight)
            held = [shape for shape in self.warm if type(shape) is type(tight) and usable(shape)]
            held = [shape for shape in held if shape.holds(tight, fixed_references)]
            if not held:
                return Fit(tight, tight)
            self.counts["larger"] += 1
        return Fit(tight, min(held, key=lambda shape: (shape.tokens, str(shape))))

    def behind(self, shape, compile_it: Callable[[], None]) -> None:
        """Compile `shape`'s programs by `compile_it()` on the compiling thread, unless warm or queued;
        `shape` is warm once it returns."""
        with self._lock:
            if shape in self.warm or shape in self.pending:
                return
            self.pending.add(shape)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._compile, name="klein-compile-behind", daemon=True
                )
                self._thread.start()
        self._queue.put((shape, compile_it))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or compiling (tests, benchmarks); whether that happened in time."""
        done = threading.Event()
        self._queue.put((None, done.set))
        return done.wait(timeout)

    def _compile(self) -> None:
        """The compiling thread: one shape at a time, at the lowest CPU priority (Linux sets it per thread),
        its programs counted as built behind (`compilations.BUILT_BEHIND`)."""
        compilations.behind()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # not Linux, or not allowed: a normal priority
            pass
        while True:
            shape, compile_it = self._queue.get()
            try:
                if shape is not None and not self.allowed():  # the weights may move now: the foreground's
                    continue
                compile_it()
                if shape is not None:
                    with self._lock:
                        self.warm.add(shape)
                        self.counts["compiled"] += 1
            except Exception:  # the foreground compiles it when a request needs it, as without this thread
                log.exception("compiling %s behind the requests failed", shape)
                with self._lock:
                    self.counts["failed"] += 1
            finally:
                with self._lock:
                    self.pending.discard(shape)

    def report(self, fit: Fit, real_tokens: tuple[int, int], images: int) -> dict:
        """What a request ran on, for its response (`klein.buckets`): the tokens of its image and its
        references, the buckets of its own shape and of the shape it ran on, the padded tokens, and the
        shapes still compiling behind."""
        used, tight = fit.used, fit.tight
        real = images * sum(real_tokens)
        return {
            "image_tokens": real_tokens[0],
            "reference_tokens": real_tokens[1],
            "bucket": [used.batch, used.image, used.references],
            "own_bucket": [tight.batch, tight.image, tight.references],
            "larger": fit.larger,
            "padded_tokens": used.tokens - real,
            "compiling_behind": len(self.pending),
        }
