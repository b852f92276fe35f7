"""Unmerged adapter products beside a Linear's base product, so that changing adapters or strengths changes
data, never the program (docs/design/lora.md, "LoRA per request"): a low-rank term (LoRA, LoHa as its exact
low-rank product) `((x @ down) * rows) @ up`, a Kronecker term (LoKr) formed from its two factors without
the full matrix, and DoRA's per-output-row gain on the product.

Axes: B images of the batch, I in features, O out features, S slots, K = S x R (slot rank R). A targeted
Linear holds a `Slots` module of `Factor` variables, each layer-major (a leading L axis on a stack's,
sliced with the layer's kernel), those of the kinds its loaded adapters have: `down` float[L?, I, K] and
`up` float[L?, K, O]; per Kronecker shape g (one for each (a, b, c, d) the loaded LoKrs have on the Linear),
`w1_g` float[L?, S, T, a, b] and `w2_g` float[L?, S, T, c, d] (slot s's update the sum over T terms of
kron(w1, w2), O = a c, I = b d); and DoRA's float32 `norm` [L?, O] (||W_o||^2 of the weight in use), `cross` [L?, S, O]
(<W_o, D_o>), `square` [L?, S, O] (||D_o||^2), `magnitude` [L?, S, O] and `dora` [L?, S] (1 where the
slot's update on this layer is DoRA). The batch's `rows` float32[B, K + 2 S] hold the low-rank columns'
weights, then each slot's strength, then whether the row uses the slot (0 or 1).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping

import jax.numpy as jnp
from flax import nnx

PARTS = ("down", "up", "norm", "cross", "square", "magnitude", "dora")
"""The arrays a Linear's slots may hold (see the module's doc), beside the Kronecker factors `w1_g`, `w2_g`."""


class Factor(nnx.Variable):
    """One array of a Linear's adapter slots (not a checkpoint weight)."""


class Slots(nnx.Module):
    """The adapter slots' arrays of one Linear (`PARTS`, None for a kind none of its adapters has; and
    `groups` pairs of Kronecker factors `w1_g`, `w2_g`)."""

    def __init__(self, arrays: Mapping[str, object]):
        for name in PARTS:
            setattr(self, name, Factor(arrays[name]) if name in arrays else nnx.data(None))
        self.groups = sum(name.startswith("w1_") for name in arrays)
        for group in range(self.groups):
            for name in (f"w1_{group}", f"w2_{group}"):
                setattr(self, name, Factor(arrays[name]))


Bank = Mapping[tuple, Mapping[str, object]]
"""Linear path in the model -> its slots' arrays by name (`PARTS`), as `attached` takes them."""

_ROWS: contextvars.ContextVar = contextvars.ContextVar("klein_adapter_rows", default=None)


@contextlib.contextmanager
def attached(model: nnx.Module, bank: Bank, rows):
    """Within: the Linears of `model` at the paths of `bank` carry its arrays, and the products read
    `rows` float32[B, K + 2 S]. Entered inside a traced function: the arrays are its arguments."""
    modules = dict(nnx.iter_modules(model))
    for path, arrays in bank.items():
        modules[path].adapter = Slots(arrays)
    try:
        with weighting(rows):
            yield model
    finally:
        for path in bank:
            modules[path].adapter = nnx.data(None)


@contextlib.contextmanager
def weighting(rows):
    """Within: `term` weights the batch's rows by `rows` float32[B, K + 2 S]."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextlib.contextmanager
def batch_slice(start: int, stop: int):
    """Within: `term` weights the rows [start, stop) of the batch's rows, for a pass over those images alone
    (no-op without adapters)."""
    rows = _ROWS.get()
    with weighting(None if rows is None else rows[start:stop]):
        yield


def _value(part):
    return None if part is None else part[...]


def term(x, slots: Slots, outputs: slice = slice(None)):
    """(extra float32[..., O'], gain float32[B, 1.., O'] or None) of x float[B, ..., I] for one layer's
    `slots`, each row of the batch weighted by its row of the rows set in `attached`, over output columns
    `outputs` (O' of them): the Linear's output is `gain * base + extra` (`products.product`). `gain` is
    DoRA's, None where no slot of this layer is DoRA. An input of one row shared by the whole batch (a
    prefill's references, modulations at t = 0) is weighted by the first row: the pipeline runs such
    inputs for batches of one LoRA set only."""
    rows = _ROWS.get()
    if rows is None:
        raise RuntimeError("a Linear with adapters ran outside `adapters.weighting`")
    if x.shape[0] != rows.shape[0]:
        rows = rows[:1]
    down, up = _value(slots.down), _value(slots.up)
    k = 0 if down is None else down.shape[-1]
    count = (rows.shape[1] - k) // 2
    strengths, used = rows[:, k : k + count], rows[:, k + count :]

    def per_row(weights):  # float32[B, ...] -> broadcast over x's token axes
        return weights.reshape(weights.shape[:1] + (1,) * (x.ndim - 2) + weights.shape[1:])

    gains = gain = None
    if slots.magnitude is not None:
        gains = _gains(slots, strengths, used, outputs)  # [B, S, O']
        gain = per_row(1 + (gains - 1).sum(axis=1))
    extra = jnp.zeros((), jnp.float32)
    if down is not None:
        up = up[..., outputs]
        low = jnp.dot(x.astype(down.dtype), down, preferred_element_type=jnp.float32) * per_row(rows[:, :k])
        if gains is None:
            extra = extra + jnp.dot(low.astype(up.dtype), up, preferred_element_type=jnp.float32)
        else:  # each slot's columns of `up` scaled by its gain, per row of the batch
            scaled = up * jnp.repeat(gains, k // count, axis=1)  # [B, K, O']
            extra = extra + jnp.einsum(
                "b...k,bko->b...o", low.astype(up.dtype), scaled.astype(up.dtype),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
    for group in range(slots.groups):
        w1, w2 = getattr(slots, f"w1_{group}")[...], getattr(slots, f"w2_{group}")[...]
        for slot in range(count):
            weight = strengths[:, slot, None]
            if gains is not None:
                weight = weight * gains[:, slot]
            terms = sum(kronecker(x, one, two, outputs) for one, two in zip(w1[slot], w2[slot], strict=True))
            extra = extra + terms * per_row(weight)
    return extra, gain


def _gains(slots: Slots, strengths, used, outputs: slice):
    """float32[B, S, O']: DoRA's g = m / ||W + s D||_row of each slot at each row's strength s, from
    ||W + s D||^2 = ||W||^2 + 2 s <W, D> + s^2 ||D||^2; 1 where a row does not use the slot or the slot's
    update on this layer is not DoRA."""
    norm, cross, square, magnitude = (
        getattr(slots, name)[..., outputs] for name in ("norm", "cross", "square", "magnitude")
    )
    s = strengths[:, :, None]
    squared = norm + 2 * s * cross + s * s * square
    g = magnitude / jnp.sqrt(jnp.maximum(squared, jnp.finfo(jnp.float32).tiny))
    on = (used * slots.dora[...])[:, :, None]
    return jnp.where(on > 0, g, 1.0)


def kronecker(x, w1, w2, outputs: slice = slice(None)):
    """float32[..., O'] = x @ kron(w1, w2)^T[:, outputs] for x float[..., I], w1 float[a, b], w2 float[c, d]
    (O = a c, I = b d), without the full matrix: with X = x reshaped [b, d] (row-major, as `np.kron` indexes
    its columns), the output reshaped [a, c] is w1 X w2^T. Output columns that are whole rows of w1 (multiples
    of c) are computed alone."""
    (a, b), (c, d) = w1.shape, w2.shape
    start, stop, _ = outputs.indices(a * c)
    if start % c == 0 and stop % c == 0:
        w1, cut = w1[start // c : stop // c], slice(None)
    else:
        cut = slice(start, stop)
    grid = x.astype(w2.dtype).reshape(*x.shape[:-1], b, d)
    out = jnp.einsum("pq,...qj,ij->...pi", w1, grid, w2, preferred_element_type=jnp.float32)
    return out.reshape(*x.shape[:-1], -1)[..., cut]


def run(fn, model, adapters, *args):
    """`fn(model, *args)`, with `adapters` = (bank, rows) attached (`attached`), or as it is for None."""
    if adapters is None:
        return fn(model, *args)
    bank, rows = adapters
    with attached(model, bank, rows):
        return fn(model, *args)
