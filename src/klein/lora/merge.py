"""Merging adapter updates (LoRA, LoHa, LoKr, DoRA: `klein.lora.kinds`) into the transformer's weights, and
taking them out again: in the layout each kernel is stored in, widening (FP8, quantisation blocks) or
quantising again (8-bit products) where an adapter touches it, and where the kernel lives
(docs/design/lora.md, docs/design/checkpoints.md "Merging", docs/design/memory.md `stream`). Low-rank updates
of a kernel are summed as one product; Hadamard and Kronecker products are formed from their factors on the
device; a DoRA update then rescales each output row of the weight merged so far to its magnitude. Axes: L
stacked layers, I in features, O out features, r rank.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.lora import kinds
from klein.lora.targets import Update
from klein.models import products
from klein.models.stacks import as_bits, as_float

Weighted = tuple[Update, float]
"""An update and the user's strength for its LoRA."""
_EIGHT_BIT = {np.dtype(operand): compute for compute, (operand, _, _) in products.EIGHT_BIT.items()}
"""The 8-bit product a kernel of each dtype is stored for."""


def merge_kernel(
    kernel: np.ndarray,
    weight_scale,
    updates: list[Weighted],
    dtype,
    sharding=None,
    out_in: bool = False,
    blocks: str | tuple[str, ...] | None = None,
    compute: str | None = None,
) -> tuple[jax.Array, np.ndarray | None]:
    """(kernel, scale): kernel float[L?, I, O] ([L?, O, I] if `out_in`; 8-bit with weight_scale float32[L?]
    or [L?, O], else weight_scale None; rows of quantisation blocks of format `blocks` [L?, O, bytes]) plus
    the updates, in `dtype`, placed with `sharding`, a stack in its stored form
    (`klein.models.stacks.as_bits`); and the scale that now goes with it: None without a weight_scale, else
    ones. For a kernel stored for an 8-bit `compute` (`products.EIGHT_BIT`), the sum in `dtype` quantised
    again for it: 8-bit [L?, O, I] and its scales float32[L?, O], one per output channel.

    A stack is merged layer by layer, each touched layer formed on the device by one program (`_merged`)
    wherever the stack lives, so a stack in host memory merges to the values a device stack does without
    ever coming to the device whole."""
    scales = np.ones(kernel.shape[:-2], np.float32) if weight_scale is None else weight_scale
    shape = kernel.shape
    if blocks is not None:
        shape = (*kernel.shape[:-1], products.unpacked_width(blocks, kernel.shape[-1]))
    stored = dtype if compute is None else products.EIGHT_BIT[compute][0]
    if kernel.ndim == 2:
        merged, scale = _merged(
            kernel, scales, _steps(updates, shape, out_in), dtype, out_in, blocks, compute
        )
        return jax.device_put(merged, sharding), None if weight_scale is None else np.asarray(scale)
    if weight_scale is None and blocks is None:  # the layers no update touches stay as they are
        start, touched = kernel, sorted({update.layer for update, _ in updates})
    else:  # 8-bit or blocks: every layer of the stack is widened (and quantised again)
        start, touched = np.zeros(shape, stored), range(len(kernel))
    layer_scales = []

    def merged(layer: int) -> jax.Array:
        steps = _steps([(u, s) for u, s in updates if u.layer == layer], shape[1:], out_in)
        merged, scale = _merged(kernel[layer], scales[layer], steps, dtype, out_in, blocks, compute)
        layer_scales.append(scale)
        return merged

    if sharding is not None and sharding.memory_kind == "pinned_host":
        out = np.array(start) if start is kernel else start  # the kept original is not written to
        for layer in touched:
            out[layer] = jax.device_get(merged(layer))
        out = jax.device_put(as_bits(out), sharding)
    else:
        out = jax.device_put(as_bits(start), sharding)
        for layer in touched:
            out = _set_layer(out, layer, merged(layer))
    return out, None if weight_scale is None else np.stack(jax.device_get(layer_scales))


class _Step(NamedTuple):
    """Updates added together, then (DoRA) each output row rescaled: the low-rank ones as one product
    (down float32[R, I], up [O, R]; R 0 without any), the Hadamard products as factors (down1, up1, down2,
    up2), the Kronecker products as (w1, w2), each with its scale times strength folded into one factor;
    the magnitudes float32[O], or None."""

    down: np.ndarray
    up: np.ndarray
    hadamards: tuple
    kroneckers: tuple
    magnitude: np.ndarray | None


def _steps(updates: list[Weighted], shape: tuple[int, int], out_in: bool) -> tuple[_Step, ...]:
    """The updates of one kernel (or layer) as steps, in order: each DoRA update closes one (the rows are
    rescaled after it and what came before it are added); `shape` is the kernel's [I, O] ([O, I] if
    `out_in`)."""
    out, fan_in = shape if out_in else shape[::-1]
    steps, current = [], []
    for update, strength in updates:
        current.append((update, np.float32(update.scale * strength)))
        if update.magnitude is not None:
            steps.append(_step(current, out, fan_in, update.magnitude))
            current = []
    if current or not steps:
        steps.append(_step(current, out, fan_in, None))
    return tuple(steps)


def _step(updates: list[tuple[Update, np.float32]], out: int, fan_in: int, magnitude) -> _Step:
    low = [(u.form.low_rank(), s) for u, s in updates if isinstance(u.form, kinds.LowRank)]
    hadamards = tuple(
        (u.form.first.down, u.form.first.up * s, u.form.second.down, u.form.second.up)
        for u, s in updates
        if isinstance(u.form, kinds.Hadamard)
    )
    kroneckers = tuple((u.form.w1 * s, u.form.w2) for u, s in updates if isinstance(u.form, kinds.Kronecker))
    down = np.concatenate([np.zeros((0, fan_in), np.float32)] + [f.down * s for f, s in low])
    up = np.concatenate([np.zeros((out, 0), np.float32)] + [f.up for f, _ in low], axis=1)
    return _Step(down, up, hadamards, kroneckers, magnitude)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _merged(kernel, scale, steps, dtype, out_in, blocks, compute):
    """(kernel, scale) of one kernel (or layer) widened to float32 (from its blocks if `blocks` names their
    format), times its scale, with the update `steps` applied, in `dtype`, and ones for its scale; or that
    quantised for an 8-bit `compute` [O, I], and its scales float32[O]."""
    if blocks is not None:
        kernel = products.unpacked(kernel, blocks)
    factor = scale[:, None] if out_in and scale.ndim else scale  # out_in: a scale [O] multiplies rows
    weight = kernel.astype(jnp.float32) * factor
    for step in steps:
        delta = _delta(step)
        weight = weight + (delta if out_in else delta.T)
        if step.magnitude is not None:  # DoRA: each output row to its magnitude
            rows = jnp.linalg.norm(weight, axis=1 if out_in else 0)
            weight = weight * jnp.expand_dims(step.magnitude / rows, 1 if out_in else 0)
    merged = weight.astype(dtype)
    if compute is None:
        return merged, jnp.ones_like(scale)
    kernel, scale = products.quantise(merged.astype(jnp.float32), compute, -1)
    return kernel, scale[:, 0]


def _delta(step: _Step) -> jax.Array:
    """float32[O, I]: the sum of a step's updates."""

    def mm(a, b):
        return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

    delta = mm(step.up, step.down)
    for down1, up1, down2, up2 in step.hadamards:
        delta = delta + mm(up1, down1) * mm(up2, down2)
    for w1, w2 in step.kroneckers:
        delta = delta + jnp.kron(w1, w2)
    return delta


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack, layer, merged):
    # Donated: the stack is updated in place instead of copied once per layer.
    return stack.at[layer].set(as_bits(merged))


class MergedWeights:
    """The transformer's weights (an `nnx.State`, shared by everything that runs the transformer, from
    `weights()`) with one set of LoRA updates merged in. A host copy of the original of every kernel the set
    changed is kept, so another set merges from the originals and an empty set restores them exactly.
    Values are replaced in place, one kernel at a time, so the device holds at most one stack twice."""

    def __init__(self, weights, dtype, blocks=dict):
        """`weights()`: the state; `blocks()`: the paths of its kernels kept as quantisation blocks, with
        their formats (`klein.models.layers.block_formats`)."""
        self._weights = weights
        self._dtype = dtype
        self._blocks = blocks
        self._base: dict[tuple, tuple[np.ndarray, np.ndarray | None]] = {}
        self._updates: list[Weighted] = []

    @property
    def state(self) -> nnx.State:
        return self._weights()

    def merge_again(self) -> None:
        """The weights were read again from the checkpoint (residency): merge the current set into them."""
        self._base = {}
        if self._updates:
            self.merge(self._updates)

    @property
    def base_bytes(self) -> int:
        """Host memory held by the copies of original kernels (and FP8 scales)."""
        return sum(k.nbytes + (0 if s is None else s.nbytes) for k, s in self._base.values())

    def merge(self, updates: list[Weighted]) -> None:
        """Make `self.state` the original weights with exactly `updates` merged (earlier merges undone)."""
        self._updates = list(updates)
        by_path: dict[tuple, list[Weighted]] = defaultdict(list)
        flat = dict(nnx.to_flat_state(self.state))
        for update, strength in updates:
            # A kernel is stored under `kernel`, or [out, in] under `weight` for 8-bit products.
            path = update.path if update.path in flat else (*update.path[:-1], "weight")
            by_path[path].append((update, strength))
        blocks = self._blocks() if by_path else {}
        for path in sorted(set(self._base) | set(by_path)):
            self._keep_base(flat, path, path in blocks)
            kernel, scale = self._base[path]
            if path in by_path:
                dtype = self._dtype if scale is not None or path in blocks else kernel.dtype
                sharding = flat[path].get_value().sharding
                out_in = path[-1] == "weight"
                # A kernel stored [out, in] and not as blocks is stored for an 8-bit product: its dtype says which.
                compute = _EIGHT_BIT.get(np.dtype(kernel.dtype)) if out_in and path not in blocks else None
                merged = merge_kernel(
                    kernel, scale, by_path[path], dtype, sharding, out_in, blocks.get(path), compute
                )
                _set(flat, path, *merged)
            else:
                _set(flat, path, kernel, scale)
                del self._base[path]  # back to the original: nothing left to keep

    def _keep_base(self, flat, path: tuple, as_blocks: bool) -> None:
        """Keep the original of kernel `path` (quantisation blocks as their bytes) and of its scale."""
        if path not in self._base:
            scale = flat.get(_scale_path(path))
            kernel = np.asarray(jax.device_get(flat[path].get_value()))
            self._base[path] = (
                kernel if as_blocks else as_float(kernel),
                None if scale is None else np.asarray(jax.device_get(scale.get_value())),
            )


def _scale_path(kernel_path: tuple) -> tuple:
    return (*kernel_path[:-1], "weight_scale")


def _set(flat, path: tuple, kernel, scale) -> None:
    """Replace a kernel (and its FP8 scale) in place, on the devices and shards the old value had, and
    in its stored form: a stack (a kernel with a layer axis) as its bits, `klein.models.stacks`. The
    form is the value's own, not the old one's: an FP8 stack widened to float32 is stored as floats, and
    its original comes back as bits."""
    for key, value in ((path, kernel), (_scale_path(path), scale)):
        if value is not None:
            old = flat[key].get_value()
            stored = as_bits(value) if value.ndim == 3 else value
            flat[key].set_value(jax.device_put(stored, old.sharding))
