"""Double-stream and single-stream blocks of the FLUX.2 transformer.

Each block takes an `attend(q, k, v)` callable for its joint sequence: that is where the three ways of
running the model differ (full attention, reference tokens that see only themselves, cached reference
keys and values spliced in). Blocks also return their joint (k, v) after QK-norm and RoPE, which the
reference prefill keeps and every other caller lets the compiler drop.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from klein import sharding
from klein.models.layers import FeedForward, Linear, RMSNorm, modulate, split_modulation, swiglu
from klein.models.rope import apply_rope
from klein.models.transformer_config import TransformerConfig

Attend = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], jnp.ndarray]


def _heads(x: jnp.ndarray, head_dim: int) -> jnp.ndarray:
    return rearrange(x, "... (h d) -> ... h d", d=head_dim)


def _merge_heads(x: jnp.ndarray) -> jnp.ndarray:
    return rearrange(x, "... h d -> ... (h d)")


def _normed_rotated(norm, x: jnp.ndarray, rope: tuple) -> jnp.ndarray:
    """QK-norm and RoPE of a single block's queries or keys x float[B, S, H, Dh] -> float[B, S, H, Dh]; in a
    TPU's program computed heads first ([B, H, S, Dh], as a TPU's attention takes them), x transposed in its own dtype
    behind a barrier. These are columns of the block's fused product, whose output keeps its token-major
    layout for the MLP's columns; without the barrier XLA widened them to float32 first and transposed
    that (klein-4b's 1024^2 step compiled for a v5e: 64.3 GB moved a step instead of 94.5,
    `benchmarks/tpu/tpu_step_hlo.py`). The double blocks' q and k come from products of their own, which
    XLA fuses their norm into: they stay token-major (heads first there moved more)."""
    if sharding.platform() != "tpu":  # elsewhere, as they were: token-major
        return apply_rope(norm(x), rope)
    heads_first = jax.lax.optimization_barrier(jnp.swapaxes(x, 1, 2))
    return jnp.swapaxes(apply_rope(norm(heads_first), rope, heads_first=True), 1, 2)


HEADS_FIRST_PLATFORMS = ("tpu",)
"""Platforms whose single blocks turn q, k and v heads first with `klein.models.heads_first`'s kernel
(tests add "cpu", where Pallas interprets it)."""


def _heads_first_kernel(proj, head_dim: int) -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    if sharding.platform() not in HEADS_FIRST_PLATFORMS or not (mesh.empty or mesh.size == 1):
        return False
    # Imported only for programs that use it, as splash is (Pallas is slow to import).
    from klein.models import heads_first

    return heads_first.supports(proj, head_dim)


class DoubleAttention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype):
        d, dh, eps = cfg.hidden, cfg.attention_head_dim, cfg.eps
        self.to_q, self.to_k, self.to_v = (Linear(d, d, rngs, dtype) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(dh, eps, dtype), RMSNorm(dh, eps, dtype)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (Linear(d, d, rngs, dtype) for _ in range(3))
        self.norm_added_q, self.norm_added_k = RMSNorm(dh, eps, dtype), RMSNorm(dh, eps, dtype)
        self.to_out = Linear(d, d, rngs, dtype)
        self.to_add_out = Linear(d, d, rngs, dtype)
        self.head_dim = dh

    def image_qkv(self, x):
        q, k, v = (_heads(p(x), self.head_dim) for p in (self.to_q, self.to_k, self.to_v))
        return self.norm_q(q), self.norm_k(k), v

    def text_qkv(self, x):
        q, k, v = (_heads(p(x), self.head_dim) for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
        return self.norm_added_q(q), self.norm_added_k(k), v


class DoubleBlock(nnx.Module):
    """Separate weights for the text and the image stream, one joint attention over [txt, img]."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.attn = DoubleAttention(cfg, rngs, dtype)
        self.ff = FeedForward(cfg.hidden, cfg.mlp_hidden, rngs, dtype)
        self.ff_context = FeedForward(cfg.hidden, cfg.mlp_hidden, rngs, dtype)
        self.eps = cfg.eps

    def __call__(self, img, txt, img_mod, txt_mod, rope, attend: Attend, piece: int | None = None):
        """img float[B, N, D]; txt float[B, T, D] or None (reference prefill); rope over [txt, img].
        `piece`: the prefill's MLP over pieces of this many tokens (`in_pieces`), or None: whole."""
        (shift, scale, gate), (shift2, scale2, gate2) = split_modulation(img_mod, 2)
        q, k, v = self.attn.image_qkv(modulate(img, shift, scale, self.eps))
        if txt is not None:
            (c_shift, c_scale, c_gate), (c_shift2, c_scale2, c_gate2) = split_modulation(txt_mod, 2)
            qt, kt, vt = self.attn.text_qkv(modulate(txt, c_shift, c_scale, self.eps))
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((qt, q), (kt, k), (vt, v)))
        # Token-major here: each stream's products give q and k alone, and XLA fuses the norm into them.
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = _merge_heads(attend(q, k, v))
        n_txt = 0 if txt is None else txt.shape[1]
        img = img + gate * self.attn.to_out(out[:, n_txt:])
        if piece is None or txt is not None:
            img = img + gate2 * self.ff(modulate(img, shift2, scale2, self.eps))
        else:
            img = in_pieces(
                lambda x: x + gate2 * self.ff(modulate(x, shift2, scale2, self.eps)), piece, (img, 1)
            )
        if txt is not None:
            txt = txt + c_gate * self.attn.to_add_out(out[:, :n_txt])
            txt = txt + c_gate2 * self.ff_context(modulate(txt, c_shift2, c_scale2, self.eps))
        return img, txt, (k, v)


class SingleAttention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype):
        d, dh = cfg.hidden, cfg.attention_head_dim
        self.to_qkv_mlp_proj = Linear(d, 3 * d + 2 * cfg.mlp_hidden, rngs, dtype)
        self.norm_q, self.norm_k = RMSNorm(dh, cfg.eps, dtype), RMSNorm(dh, cfg.eps, dtype)
        self.to_out = Linear(d + cfg.mlp_hidden, d, rngs, dtype)


class SingleBlock(nnx.Module):
    """Parallel attention + SwiGLU MLP over the joint sequence, fused in and out projections."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.attn = SingleAttention(cfg, rngs, dtype)
        self.eps = cfg.eps
        self.head_dim = cfg.attention_head_dim
        self.width = cfg.hidden

    def __call__(self, x, mod, rope, attend: Attend):
        """x float[B, S, D]; mod float[B, 1 or S, 3D]."""
        shift, scale, gate = split_modulation(mod, 1)[0]
        proj = self.attn.to_qkv_mlp_proj(modulate(x, shift, scale, self.eps))
        q, k, v = self._qkv(proj, rope)
        out = _merge_heads(attend(q, k, v))
        mlp = swiglu(proj[..., 3 * self.width :])
        if sharding.platform() == "tpu":
            # Made once: an 8-bit to_out reads it twice (its scales, its values), and XLA computed it for
            # each (klein-4b's int8 step on a v5e: 4.3 ms less a step; bf16's program unchanged).
            mlp = jax.lax.optimization_barrier(mlp)
        return x + gate * self.attn.to_out(jnp.concatenate([out, mlp], axis=-1)), (k, v)

    def _qkv(self, proj, rope):
        """(q, k, v) float[B, S, H, Dh] of the fused projection, q and k normed and rotated. In a TPU's
        program of one device, one Pallas kernel reads them from the projection and writes them heads first
        as the TPU's attention takes them (`klein.models.heads_first`; the swaps back to token-major here
        cancel against the attention's own turn to heads first)."""
        attn, d = self.attn, self.width
        if _heads_first_kernel(proj, self.head_dim):
            from klein.models import heads_first

            scales, interpret = (attn.norm_q.scale[...], attn.norm_k.scale[...]), sharding.platform() != "tpu"
            q, k, v = heads_first.heads_first(
                proj, d, self.head_dim, *scales, attn.norm_q.eps, rope, interpret
            )
            return tuple(jnp.swapaxes(t, 1, 2) for t in (q, k, v))
        q, k, v = (_heads(p, self.head_dim) for p in jnp.split(proj[..., : 3 * d], 3, axis=-1))
        return _normed_rotated(attn.norm_q, q, rope), _normed_rotated(attn.norm_k, k, rope), v

    def rows(self, x, mod, rope, attend: Attend, start: int, stop: int):
        """The block's output for joint tokens [start, stop) only, float[B, stop - start, D].

        Exact: a token's output depends on the others only through the keys and values, which still
        come from every token; queries, MLP and output projection run over the chosen tokens alone.
        """
        shift, scale, gate = split_modulation(mod, 1)[0]
        h = modulate(x, shift, scale, self.eps)
        k, v = self._keys_values(h, rope)
        fused, d = self.attn.to_qkv_mlp_proj, self.width
        chosen = h[:, start:stop]
        q = _heads(fused.columns(chosen, 0, d), self.head_dim)
        q = _normed_rotated(self.attn.norm_q, q, tuple(t[start:stop] for t in rope))
        out = _merge_heads(attend(q, k, v))
        mlp = swiglu(fused.columns(chosen, 3 * d))
        gate = gate if gate.shape[1] == 1 else gate[:, start:stop]  # per-token modulation
        return x[:, start:stop] + gate * self.attn.to_out(jnp.concatenate([out, mlp], axis=-1))

    def pieces(self, x, mod, rope, attend: Attend, piece: int):
        """`__call__` with its queries, MLP and output projection over pieces of `piece` tokens
        (`in_pieces`; a reference prefill's, whose modulation is one for every token): the keys and values
        come from every token at once, as `rows` computes them. Exact, as `rows` is."""
        shift, scale, gate = split_modulation(mod, 1)[0]
        h = modulate(x, shift, scale, self.eps)
        k, v = self._keys_values(h, rope)
        fused, d = self.attn.to_qkv_mlp_proj, self.width

        def one(h, x, *rope):
            q = _normed_rotated(self.attn.norm_q, _heads(fused.columns(h, 0, d), self.head_dim), rope)
            out = _merge_heads(attend(q, k, v))
            mlp = swiglu(fused.columns(h, 3 * d))
            return x + gate * self.attn.to_out(jnp.concatenate([out, mlp], axis=-1))

        return in_pieces(one, piece, (h, 1), (x, 1), *((t, 0) for t in rope)), (k, v)

    def keys_values(self, x, mod, rope):
        """The block's joint (k, v) alone, as `__call__` returns them (the last block of a reference
        prefill, whose output nothing reads): only the key and value columns of the fused projection."""
        shift, scale, _ = split_modulation(mod, 1)[0]
        return self._keys_values(modulate(x, shift, scale, self.eps), rope)

    def _keys_values(self, h, rope):
        d = self.width
        k, v = (
            _heads(p, self.head_dim)
            for p in jnp.split(self.attn.to_qkv_mlp_proj.columns(h, d, 3 * d), 2, axis=-1)
        )
        return _normed_rotated(self.attn.norm_k, k, rope), v


def in_pieces(fn, piece: int, *parts):
    """`fn(*arrays)` -> float[B, S, D] over pieces of at most `piece` of the S tokens, one piece at a time
    (`jax.lax.map`: one piece's tensors live at once), joined. `parts`: (array, its token axis); the tokens
    are padded to even pieces, and the padding's rows dropped."""
    size = parts[0][0].shape[parts[0][1]]
    count = -(-size // piece)
    piece = -(-size // count)

    def cut(array, axis):
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, count * piece - size)
        array = jnp.pad(array, widths)
        array = array.reshape(*array.shape[:axis], count, piece, *array.shape[axis + 1 :])
        return jnp.moveaxis(array, axis, 0)

    out = jax.lax.map(lambda arrays: fn(*arrays), tuple(cut(a, axis) for a, axis in parts))
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(out.shape[0], count * piece, *out.shape[3:])[:, :size]
