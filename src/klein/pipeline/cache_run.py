"""A request's step cache as its denoising loop runs it: the cached step's program, each step's settings
(`klein.models.step_cache.Knobs`, data), the states carried from step to step and the decisions
gathered for the report, read back once at the end (no step waits on the host)."""

from __future__ import annotations

import numpy as np

from klein.models.step_cache import Knobs
from klein.pipeline.cache_report import CacheReport
from klein.request.modes import Conditioning

# Where TaylorSeer counts each cached stream's steps from, per group (double: image, text; single: joint),
# as cache-dit's calibrators do: from 1 (a calibrator is made during the first step, so counts one behind),
# and from 2 for the streams whose shape changes at the second step under diffusers' KV pipeline (its first
# step runs the references along): the calibrator starts again there. The double blocks' text keeps its shape.
_ORIGINS = ((1, 1), (1, 1))
_ORIGINS_KV = ((2, 1), (2, 2))


class CacheRun:
    def __init__(self, programs, run, rows: int, steps: int):
        """`run`: the resolved request (with its `cache`); `rows`: its images with the mesh's padding;
        `steps`: the steps that run."""
        cache, mode = run.request.cache, run.mode
        self._passes = 2 if mode.guided and cache.separate_cfg else 1
        self._step, self._states = programs.cached_step(mode, self._passes, cache.structure)
        kv = mode.conditioning is Conditioning.CACHED
        self._phases = cache.phases(steps, kv)
        live = np.arange(rows) < run.images
        doubled = mode.guided and self._passes == 1
        self._settings = dict(
            thresholds=np.asarray(cache.thresholds, np.float32),
            max_cached=np.int32(cache.max_cached),
            max_consecutive=np.int32(cache.max_consecutive),
            origin=np.asarray(_ORIGINS_KV if kv else _ORIGINS, np.int32),
            live=np.concatenate([live, live]) if doubled else live,
            together=np.bool_(doubled),
        )
        self._images, self._guided = run.images, mode.guided
        self._index, self._records, self._carried = 0, [], None

    def _knobs(self, index: int) -> Knobs:
        return Knobs(np.int32(index), np.int32(self._phases[index]), **self._settings)

    def step(self, x, txt, sigma, sigma_next, ropes, cond, scale, adapted):
        """The step function the loop calls as it calls an uncached one (the same arguments), after the
        states before the first step are made from these, its first step's, arguments."""
        args = (x, txt, sigma, sigma_next, ropes, cond, scale, self._knobs(0))
        self._carried = self._states.zeros(*args, adapted=adapted)

        def step(x, txt, sigma, sigma_next, ropes, cond, scale, adapted=None):
            cache = (self._carried, self._knobs(self._index))
            x, (self._carried, record) = self._step(
                x, txt, sigma, sigma_next, ropes, cond, scale, cache, adapted=adapted
            )
            self._records.append(record)
            self._index += 1
            return x

        return step

    def report(self) -> CacheReport:
        self._carried = None
        cached = np.stack([np.asarray(r.cached) for r in self._records])
        diffs = np.stack([np.asarray(r.diff, np.float32) for r in self._records])
        return CacheReport(cached, diffs, self._phases, self._images, self._guided)
