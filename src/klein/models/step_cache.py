"""Step caching inside the transformer (DBCache, as cache-dit defines it): each group of blocks (the double
blocks, then the single blocks) runs its first Fn blocks at every step, compares their residual with the one
of the last step it computed, and below a threshold reuses the residual its middle blocks gave then instead
of running them; its last Bn blocks run at every step. See docs/design/step-cache.md.

Everything here runs inside the step's program. The decision is a `lax.cond` on the device: the middle
blocks run only when some image of the batch needs them (an image that decided to reuse takes its cached
residual all the same, so every image gets what it would alone), the settings of a step are data
(`Knobs`), and the group's state (`Group`) is carried from step to step as arrays: a new threshold, mask or
limit compiles nothing. Only the structure is static (`Structure`: Fn, Bn and the TaylorSeer order).

Axes: B images (rows) of one pass, S tokens of the group's stream, D hidden.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from klein.models.facts import CACHE, COMPUTE, DYNAMIC  # noqa: F401 - the phases, read here too
from klein.sharding import TOKENS, constrain

DOUBLE, SINGLE = 0, 1


class Structure(NamedTuple):
    """What shapes the program (static): blocks computed before the decision (Fn) and after the cached
    ones (Bn), in each group, and the TaylorSeer order (0: the residual reused as it was)."""

    compute_first: int
    compute_last: int
    order: int


class Knobs(NamedTuple):
    """One step's settings, as data."""

    step: jax.Array  # int32[]: the step's index among those that run (cache-dit's step)
    phase: jax.Array  # int32[]: DYNAMIC, COMPUTE or CACHE
    thresholds: jax.Array  # float32[2]: the residual-difference threshold of each group
    max_cached: jax.Array  # int32[]: reused steps allowed per request (-1: any)
    max_consecutive: jax.Array  # int32[]: reused steps allowed in a row (-1: any)
    origin: jax.Array  # int32[2, 2]: where TaylorSeer counts steps from, per group and cached stream
    live: jax.Array  # bool[B]: the batch's real images (not the mesh's padding), which alone need compute
    together: jax.Array  # bool[]: rows i and i + B/2 (an image's prompt and negative) decide as one


class Group(NamedTuple):
    """One group's state, per row (float arrays in the activations' dtype)."""

    previous: jax.Array  # [B, S, D]: the Fn residual of the last step computed
    ladders: tuple  # per cached stream, order + 1 arrays [B, S', D]: the residual and its differences
    valid: jax.Array  # bool[streams, order + 1, B]: which differences of each stream exist yet
    computed: jax.Array  # bool[B]: whether any step computed (a previous residual exists)
    last: jax.Array  # int32[B]: the last step computed
    cached: jax.Array  # int32[B]: steps reused so far
    consecutive: jax.Array  # int32[B]: steps reused since the last computed


class Record(NamedTuple):
    """What a group decided at one step, per row: reused, and the relative residual difference."""

    cached: jax.Array  # bool[B]
    diff: jax.Array  # float32[B]


PROBE = "probe"
"""Passed as a group's state, asks for its zero state's shapes instead (`through` runs uncached)."""


def through(structure: Structure, group: int, state, knobs: Knobs, streams, run, count: int, reach, weights):
    """The group's blocks over `streams` (a tuple of [B, S, D]), cached: `run(streams, start, stop)` runs
    blocks [start, stop) of the `count`; `reach(streams)`: the rows of `streams` that the blocks after the
    middle ones read (what the middle returns, whose residual is kept); `weights` float32[S] (1 for real
    tokens, 0 for padding) or None. Returns (streams, state, Record)."""
    fn, bn = structure.compute_first, structure.compute_last
    first = run(streams, 0, fn)
    residual = first[0] - streams[0]
    if state is PROBE:
        middle = run(first, fn, count - bn)
        state = _zeros(structure.order, residual, middle, len(knobs.live))
        return run(middle, count - bn, count), state, None
    cached, diff = decide(state, knobs, group, residual, weights)
    base = reach(first)

    def computed(state):
        middle = run(first, fn, count - bn)
        reused = _estimate(state, knobs.step)
        out = tuple(jnp.where(_rows(cached), b + r, m) for b, r, m in zip(base, reused, middle, strict=True))
        fresh = tuple(m - b for m, b in zip(middle, base, strict=True))
        return out, _update(state, ~cached, residual, fresh, knobs, knobs.origin[group])

    def reused(state):
        return tuple(b + r for b, r in zip(base, _estimate(state, knobs.step), strict=True)), state

    out, state = jax.lax.cond(jnp.any(~cached & knobs.live), computed, reused, state)
    state = state._replace(
        cached=state.cached + cached, consecutive=jnp.where(cached, state.consecutive + 1, 0)
    )
    return run(out, count - bn, count), state, Record(cached, diff)


def decide(state: Group, knobs: Knobs, group: int, residual, weights):
    """(bool[B] reuse, float32[B] relative difference) for the Fn residual [B, S, D] of this step, as
    cache-dit's `can_cache`: the step's phase, then the limits, then |previous - residual| / |previous|
    (means over the real tokens) under the group's threshold (1 or more: always; 0 or less: never)."""
    previous = state.previous.astype(jnp.float32)
    apart = jnp.abs(previous - residual.astype(jnp.float32))
    size = jnp.abs(previous)
    if weights is not None:
        apart, size = apart * weights[None, :, None], size * weights[None, :, None]
    num, den = apart.sum((1, 2)), size.sum((1, 2))
    half = num.shape[0] // 2
    num = jnp.where(knobs.together, num + jnp.roll(num, half), num)
    den = jnp.where(knobs.together, den + jnp.roll(den, half), den)
    diff = num / jnp.where(den > 0, den, 1.0)
    threshold = knobs.thresholds[group]
    room = ((knobs.max_cached < 0) | (state.cached < knobs.max_cached)) & (
        (knobs.max_consecutive < 0) | (state.consecutive < knobs.max_consecutive)
    )
    similar = (threshold >= 1.0) | (diff < threshold)
    dynamic = room & (threshold > 0) & state.computed & similar
    cached = jnp.where(knobs.phase == COMPUTE, False, jnp.where(knobs.phase == CACHE, True, dynamic))
    return cached, diff


def _estimate(state: Group, step):
    """The residuals a reused step adds, per cached stream: the last computed one, or with TaylorSeer its
    expansion to `step` from the differences known (each order only where the lower ones exist)."""
    elapsed = (step - state.last).astype(jnp.float32)
    out = []
    for ladder, valid in zip(state.ladders, state.valid, strict=False):
        total = ladder[0]
        for i in range(1, len(ladder)):
            weight = jnp.where(valid[i], elapsed**i / math.factorial(i), 0.0)
            total = total + (_rows(weight) * ladder[i].astype(jnp.float32)).astype(total.dtype)
        out.append(total)
    return tuple(out)


def _update(state: Group, rows, residual, fresh, knobs: Knobs, origins) -> Group:
    """`state` with the rows `rows` (bool[B]) computed at this step: their Fn residual, and each stream's
    residual with its differences against the last ones (TaylorSeer's ladder: order i + 1 exists when order
    i did and the step is more than one past the stream's `origins` (int32[2], as cache-dit's calibrator
    counts: from 1, since it is made during the first step, or from 2 for a stream whose shape changed at
    the second: KV editing's image tokens)."""
    window = (knobs.step - state.last).astype(jnp.float32)
    ladders, valid = [], []
    for k, (old, new) in enumerate(zip(state.ladders, fresh, strict=True)):
        deep = knobs.step - origins[k] > 1
        exists = [jnp.ones_like(rows)]
        ladder = [new]
        for i in range(1, len(old)):
            exists.append(exists[-1] & state.valid[k, i - 1] & deep)
            ladder.append(((ladder[-1].astype(jnp.float32) - old[i - 1]) / _rows(window)).astype(new.dtype))
        ladders.append(tuple(_keep(rows, n, o) for n, o in zip(ladder, old, strict=True)))
        valid.append(jnp.stack(exists))
    return state._replace(
        previous=_keep(rows, residual, state.previous),
        ladders=tuple(ladders),
        valid=jnp.where(rows[None, None], jnp.stack(valid), state.valid),
        computed=state.computed | rows,
        last=jnp.where(rows, knobs.step, state.last),
    )


def _keep(rows, new, old):
    return constrain(jnp.where(_rows(rows), new, old), TOKENS)


def _rows(values):
    """Per-row values [B] broadcast over a stream [B, S, D]."""
    return values[:, None, None]


def _zeros(order: int, residual, middle, batch: int) -> Group:
    """A group's state before its first step (traced for its shapes only: `PROBE`)."""

    def zeros(a):
        return jnp.zeros(a.shape, a.dtype)

    def flags(dtype):
        return jnp.zeros((batch,), dtype)

    return Group(
        zeros(residual),
        tuple((zeros(m),) * (order + 1) for m in middle),
        jnp.zeros((len(middle), order + 1, batch), jnp.bool_),
        flags(jnp.bool_),
        flags(jnp.int32),
        flags(jnp.int32),
        flags(jnp.int32),
    )
