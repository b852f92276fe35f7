"""Building blocks of the FLUX.2 transformer (Flax NNX), named after diffusers' parameters.

Axes as in `klein.models`. Modulation tensors are float[B, 1, D] (one timestep per image) or
float[B, S, D] (per token, when reference tokens are modulated at another timestep than the image tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from klein.models import adapters, products, transcendentals


class Linear(nnx.Module):
    """`x @ kernel` without bias (FLUX.2 has none anywhere), computed in `dtype`.

    The layer gathers its stored arrays into one `products.Weight` (`stored`) for `products.product`,
    which alone knows how each stored form is multiplied. The kernel float[in, out] is `kernel`, or
    `weight` [out, in] (PyTorch's layout) when stored for 8-bit products or as a file's quantisation
    blocks (`store`; docs/design/checkpoints.md, "How a stored layer becomes a product").
    """

    def __init__(self, d_in: int, d_out: int, rngs: nnx.Rngs, dtype):
        self.kernel = nnx.Param(_KERNEL_INIT(rngs.params(), (d_in, d_out), dtype))
        self.weight: nnx.Param | None = nnx.data(None)  # the kernel [out, in], for 8-bit products
        self.weight_scale: nnx.Param | None = nnx.data(None)  # a Param once stored in 8 bits
        self.input_scale: nnx.Param | None = nnx.data(None)  # a Param where a file gives one
        # the adapter slots of the unmerged products, attached while a stage runs (`klein.models.adapters`)
        self.adapter: adapters.Slots | None = nnx.data(None)
        self.dtype = dtype
        self.compute = products.BF16
        self.blocks: str | tuple[str, ...] | None = None  # the format of a kernel stored as blocks

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self._product(x, slice(None))

    def columns(self, x: jnp.ndarray, start: int, stop: int | None = None) -> jnp.ndarray:
        """`self(x)[..., start:stop]`, computing only those outputs."""
        return self._product(x, slice(start, stop))

    def _product(self, x, outputs: slice):
        extra = gain = None
        if self.adapter is not None:
            extra, gain = adapters.term(x, self.adapter, outputs)
        return products.product(x, self.stored().outputs(outputs), self.dtype, extra, gain)

    def stored(self) -> products.Weight:
        """The stored weight as the product reads it: the kernel (`weight` if stored [out, in]), its
        scales and how it is multiplied."""
        out_in = self.weight is not None
        return products.Weight(
            (self.weight if out_in else self.kernel)[...],
            scale=None if self.weight_scale is None else self.weight_scale[...],
            input_scale=None if self.input_scale is None else self.input_scale[...],
            compute=self.compute,
            out_in=out_in,
            blocks=self.blocks,
        )

    def store(self, form: Stored) -> None:
        """Switch storage to `form`'s 8-bit kernel and float32 scale (one per leading layer index, and per
        output channel if the form says so); [out, in] as `weight` for an 8-bit product, and rows of
        quantisation blocks [out, bytes] (a per-tensor scale for NVFP4 only) for a block format."""
        shape = self.kernel[...].shape
        if form.blocks is not None:
            rows = (shape[-1], products.packed_width(form.blocks, shape[-2]))
            self.weight = nnx.Param(jnp.zeros(shape[:-2] + rows, jnp.uint8))
            self.kernel = nnx.data(None)
            self.blocks = form.blocks
        elif form.compute in products.EIGHT_BIT:
            self.weight = nnx.Param(jnp.zeros(shape[:-2] + shape[:-3:-1], form.kernel))
            self.kernel = nnx.data(None)
        else:
            self.kernel = nnx.Param(jnp.zeros(shape, form.kernel))
        if form.blocks in (None, products.NVFP4):  # GGUF blocks carry all their scales
            self.weight_scale = nnx.Param(jnp.ones(shape[:-2] + shape[-1:] * form.per_channel, jnp.float32))
        if form.input_scale:
            self.input_scale = nnx.Param(jnp.ones(shape[:-2], jnp.float32))
        self.compute = form.compute


@dataclasses.dataclass(frozen=True)
class Stored:
    """A Linear's stored form: its 8-bit kernel dtype, a scale per output channel (else per tensor), how
    its product is made (bf16, fp8 or int8), and whether a per-tensor activation scale is stored (an FP8
    file's `input_scale`) for an 8-bit product; or the block format (`products.BLOCKS`) of a kernel kept
    as a file's quantisation blocks, or quantised at load into them (`at_load`, for a block-scaled
    product: `products.BLOCK_SCALED`)."""

    kernel: type
    per_channel: bool
    compute: str
    input_scale: bool = False
    blocks: str | tuple[str, ...] | None = None
    at_load: bool = False


SHIPPED_FP8 = Stored(jnp.float8_e4m3fn, per_channel=False, compute=products.BF16)
"""BFL's FP8 files as they come: per-tensor scales, widened inside a bf16 product."""


def packed(blocks: str | tuple[str, ...]) -> Stored:
    """A kernel kept in a file's quantisation blocks of format `blocks` (a ggml type, or NVFP4), widened
    to the compute dtype inside each product."""
    return Stored(jnp.uint8, per_channel=False, compute=products.BF16, blocks=blocks)


def quantised(compute: str) -> Stored:
    """The form a weight takes when quantised at load for `compute`'s 8-bit or block-scaled products."""
    if compute in products.BLOCK_SCALED:
        return Stored(jnp.uint8, per_channel=False, compute=compute, blocks=compute, at_load=True)
    return Stored(products.EIGHT_BIT[compute][0], per_channel=True, compute=compute)


# nnx.Linear's default initialiser, so random models (tests, demo) are drawn exactly as before.
_KERNEL_INIT = nnx.initializers.lecun_normal()


def store(model: nnx.Module, forms: Mapping[tuple, Stored]) -> nnx.Module:
    """`model` with the `Linear` layers at the module paths of `forms` stored so (call inside
    `nnx.eval_shape` to build the abstract model a checkpoint is loaded into). Stacked layers keep their
    layer axis."""
    found = {path: module for path, module in nnx.iter_modules(model) if isinstance(module, Linear)}
    unknown = set(forms) - set(found)
    if unknown:
        raise ValueError(f"not Linear layers of this model: {sorted(unknown)}")
    for path, form in forms.items():
        found[path].store(form)
    return model


def block_formats(model: nnx.Module) -> dict[tuple, str | tuple[str, ...]]:
    """The state paths of `model`'s kernels kept as quantisation blocks (`Linear.weight`), with their
    formats."""
    return {
        (*path, "weight"): module.blocks
        for path, module in nnx.iter_modules(model)
        if isinstance(module, Linear) and module.blocks is not None
    }


def layer_norm(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """LayerNorm without affine parameters, computed in float32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def modulate(x: jnp.ndarray, shift: jnp.ndarray, scale: jnp.ndarray, eps: float) -> jnp.ndarray:
    return (1 + scale) * layer_norm(x, eps) + shift


def swiglu(x: jnp.ndarray) -> jnp.ndarray:
    gate, value = jnp.split(x, 2, axis=-1)
    return transcendentals.silu(gate) * value


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned weight, computed in float32 (QK-norm)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class FeedForward(nnx.Module):
    def __init__(self, dim: int, hidden: int, rngs: nnx.Rngs, dtype):
        self.linear_in = Linear(dim, 2 * hidden, rngs, dtype)
        self.linear_out = Linear(hidden, dim, rngs, dtype)

    def __call__(self, x):
        return self.linear_out(swiglu(self.linear_in(x)))


class Modulation(nnx.Module):
    """`sets` groups of (shift, scale, gate) computed from the timestep embedding."""

    def __init__(self, dim: int, sets: int, rngs: nnx.Rngs, dtype):
        self.linear = Linear(dim, 3 * sets * dim, rngs, dtype)

    def __call__(self, temb: jnp.ndarray) -> jnp.ndarray:
        """float[B, D] -> float[B, 1, 3 * sets * D]; split it with `split_modulation`."""
        return self.linear(transcendentals.silu(temb))[:, None, :]


def split_modulation(mod: jnp.ndarray, sets: int) -> list[tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]]:
    chunks = jnp.split(mod, 3 * sets, axis=-1)
    return [tuple(chunks[3 * i : 3 * i + 3]) for i in range(sets)]


def timestep_features(t: jnp.ndarray, channels: int) -> jnp.ndarray:
    """Sinusoidal features of t float[B] in [0, 1] (scaled by 1000), [cos, sin] order -> float[B, channels]."""
    half = channels // 2
    freqs = transcendentals.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = (t.astype(jnp.float32) * 1000.0)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


class TimestepEmbedder(nnx.Module):
    def __init__(self, channels: int, dim: int, rngs: nnx.Rngs, dtype):
        self.linear_1 = Linear(channels, dim, rngs, dtype)
        self.linear_2 = Linear(dim, dim, rngs, dtype)

    def __call__(self, features):
        return self.linear_2(transcendentals.silu(self.linear_1(features)))


class TimeGuidanceEmbed(nnx.Module):
    """Holds the timestep embedder under diffusers' name; klein has no guidance embedder."""

    def __init__(self, channels: int, dim: int, rngs: nnx.Rngs, dtype):
        self.timestep_embedder = TimestepEmbedder(channels, dim, rngs, dtype)
        self.channels = channels

    def __call__(self, t: jnp.ndarray) -> jnp.ndarray:
        features = timestep_features(t, self.channels)
        return self.timestep_embedder(features.astype(self.timestep_embedder.linear_1.dtype))


class AdaNormOut(nnx.Module):
    """Final adaptive LayerNorm; the linear's halves are (scale, shift) in diffusers' order."""

    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, dtype):
        self.linear = Linear(dim, 2 * dim, rngs, dtype)
        self.eps = eps

    def __call__(self, x, temb):
        scale, shift = jnp.split(self.linear(transcendentals.silu(temb))[:, None, :], 2, axis=-1)
        return modulate(x, shift, scale, self.eps)
