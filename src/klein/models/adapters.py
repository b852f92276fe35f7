"""Unmerged LoRA products: a Linear's low-rank term `((x @ down) * rows) @ up`, beside its base product,
so that changing LoRAs or strengths changes data, never the program (docs/design/lora.md, "LoRA per
request").

Axes: B images of the batch, I in features, O out features, K = slots x rank. A targeted Linear holds
`down` float[L?, I, K] and `up` float[L?, K, O] as `Factor` variables (layer-major, sliced with the
layer's kernel); `rows` float32[B, K] weights each slot per row of the batch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping

import jax.numpy as jnp
from flax import nnx


class Factor(nnx.Variable):
    """One low-rank factor of a Linear's adapter term (not a checkpoint weight)."""


Bank = Mapping[tuple, tuple]
"""Linear path in the model -> (down, up) of every slot, as `attached` takes them."""

_ROWS: contextvars.ContextVar = contextvars.ContextVar("klein_adapter_rows", default=None)


@contextlib.contextmanager
def attached(model: nnx.Module, bank: Bank, rows):
    """Within: the Linears of `model` at the paths of `bank` carry its factors, and the products read
    `rows` float32[B, K]. Entered inside a traced function: the factors are its arguments."""
    modules = dict(nnx.iter_modules(model))
    for path, (down, up) in bank.items():
        linear = modules[path]
        linear.adapter_down, linear.adapter_up = Factor(down), Factor(up)
    try:
        with weighting(rows):
            yield model
    finally:
        for path in bank:
            modules[path].adapter_down = modules[path].adapter_up = nnx.data(None)


@contextlib.contextmanager
def weighting(rows):
    """Within: `term` weights the batch's rows by `rows` float32[B, K]."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def term(x, down, up):
    """float32[..., O]: the low-rank term of x float[B, ..., I] with one layer's factors down float[I, K]
    and up float[K, O], each row of the batch weighted by its row of the rows set in `attached`. An input
    of one row shared by the whole batch (a prefill's references, modulations at t = 0) is weighted by the
    first row: the pipeline runs such inputs for batches of one LoRA set only."""
    rows = _ROWS.get()
    if rows is None:
        raise RuntimeError("a Linear with adapters ran outside `adapters.weighting`")
    if x.shape[0] != rows.shape[0]:
        rows = rows[:1]
    low = jnp.dot(x.astype(down.dtype), down, preferred_element_type=jnp.float32)
    weights = rows.reshape(rows.shape[:1] + (1,) * (x.ndim - 2) + rows.shape[1:])
    low = (low * weights).astype(up.dtype)
    return jnp.dot(low, up, preferred_element_type=jnp.float32)


def run(fn, model, adapters, *args):
    """`fn(model, *args)`, with `adapters` = (bank, rows) attached (`attached`), or as it is for None."""
    if adapters is None:
        return fn(model, *args)
    bank, rows = adapters
    with attached(model, bank, rows):
        return fn(model, *args)
