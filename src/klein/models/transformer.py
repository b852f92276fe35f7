"""The FLUX.2 [klein] transformer and the ways to run it.

Axes: B batch, N image tokens, R reference tokens (all references of a request, concatenated),
T text tokens, C token channels (128), J text-embedding width, D model width, L layers,
H heads, Dh head dim. Rope tables are (cos, sin) float32[tokens, Dh] from `rope.rope_tables`.

Ways to run (explicit functions, no mode strings):
- `forward`: text-to-image, or standard editing with `refs` appended after the image tokens,
  modulated at the current timestep, full attention (klein-4b / 9b / base);
- `prefill` + `forward_cached`: KV editing (klein-9b-kv). The prefill runs the reference tokens
  alone, modulated at t = 0 and attending only to themselves, and returns every layer's reference
  keys and values. Those depend on nothing but the references, so one `ReferenceKV` (no batch axis)
  serves every image of a batch, every step and every later request with the same references.
- `forward_kv_uncached`: the same KV semantics in one pass over [txt, ref, img] with per-token
  modulation and a mask (how the reference implementation runs step 0); a check on the cache.

Layers are stacked and run with `jax.lax.scan`: compile time no longer grows with depth.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from klein.models.attention import attention
from klein.models.blocks import DoubleBlock, SingleBlock
from klein.models.layers import AdaNormOut, Modulation, TimeGuidanceEmbed, linear
from klein.models.rope import concat_tables
from klein.models.transformer_config import TransformerConfig
from klein.sharding import REFERENCE_KV, TOKENS, constrain


class ReferenceKV(NamedTuple):
    """Per-layer keys and values of the reference tokens, after QK-norm and RoPE. No batch axis."""

    double_k: jnp.ndarray  # [L_double, R, H, Dh]
    double_v: jnp.ndarray
    single_k: jnp.ndarray  # [L_single, R, H, Dh]
    single_v: jnp.ndarray

    @property
    def num_tokens(self) -> int:
        return self.double_k.shape[1]


def _stack(make, count: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0)
    def build(rngs):
        return make(rngs)

    return build(rngs)


class Flux2Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d = cfg.hidden
        self.cfg = cfg
        self.time_guidance_embed = TimeGuidanceEmbed(cfg.timestep_guidance_channels, d, rngs, dtype)
        self.double_stream_modulation_img = Modulation(d, 2, rngs, dtype)
        self.double_stream_modulation_txt = Modulation(d, 2, rngs, dtype)
        self.single_stream_modulation = Modulation(d, 1, rngs, dtype)
        self.x_embedder = linear(cfg.in_channels, d, rngs, dtype)
        self.context_embedder = linear(cfg.joint_attention_dim, d, rngs, dtype)
        self.transformer_blocks = _stack(lambda r: DoubleBlock(cfg, r, dtype), cfg.num_layers, rngs)
        self.single_transformer_blocks = _stack(
            lambda r: SingleBlock(cfg, r, dtype), cfg.num_single_layers, rngs
        )
        self.norm_out = AdaNormOut(d, cfg.eps, rngs, dtype)
        self.proj_out = linear(d, cfg.in_channels, rngs, dtype)
        # Scan unroll factor; `True` unrolls every layer (only for measuring compile time).
        self.scan_unroll = 1


def _scan(model, blocks, body, carry, xs=None):
    """Run `body(block, carry, layer_xs) -> (carry, ys)` over a stack of blocks.

    The carry is token streams float[B, S, D]; pinning their layout at every layer keeps batch and
    tokens split (data / context parallelism) instead of leaving it to propagation.
    """
    graphdef, params = nnx.split(blocks)

    def step(carry, inputs):
        layer_params, layer_xs = inputs
        carry = jax.tree.map(lambda x: constrain(x, TOKENS), carry)
        return body(nnx.merge(graphdef, layer_params), carry, layer_xs)

    return jax.lax.scan(step, carry, (params, xs), unroll=model.scan_unroll)


def _modulations(model, t):
    temb = model.time_guidance_embed(t)
    return temb, (
        model.double_stream_modulation_img(temb),
        model.double_stream_modulation_txt(temb),
        model.single_stream_modulation(temb),
    )


def _full(q, k, v):
    return attention(q, k, v)


def _always_full(_layer_kv):
    return _full


def _run(model, img, txt, mods, rope, attend=_always_full, kv=None):
    """Double then single blocks over [txt, img]; returns the image stream's hidden states.

    `mods` may be per token (see `forward_kv_uncached`). `attend(layer_kv)` gives each layer's
    attention; `kv` is the per-layer input it gets ((double, single) stacks, or None).
    """
    img_mod, txt_mod, single_mod = mods
    kv_double, kv_single = kv if kv is not None else (None, None)

    def double(block, carry, layer_kv):
        img, txt = carry
        img, txt, _ = block(img, txt, img_mod, txt_mod, rope, attend(layer_kv))
        return (img, txt), None

    (img, txt), _ = _scan(model, model.transformer_blocks, double, (img, txt), kv_double)

    def single(block, x, layer_kv):
        return block(x, single_mod, rope, attend(layer_kv))[0], None

    x, _ = _scan(model, model.single_transformer_blocks, single, jnp.concatenate([txt, img], 1), kv_single)
    return x[:, txt.shape[1] :]


def _velocity(model, h, temb):
    return model.proj_out(model.norm_out(h, temb))


def forward(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, refs=None):
    """Velocity float[B, N, C] for image tokens img float[B, N, C], text txt float[B, T, J], t float[B].

    refs: optional (tokens float[B or 1, R, C], rope) appended after the image tokens (standard editing).
    """
    n_img = img.shape[1]
    rope = concat_tables(txt_rope, img_rope)
    if refs is not None:
        ref_tokens, ref_rope = refs
        ref_tokens = jnp.broadcast_to(ref_tokens, (img.shape[0], *ref_tokens.shape[1:]))
        img = jnp.concatenate([img, ref_tokens.astype(img.dtype)], axis=1)
        rope = concat_tables(rope, ref_rope)
    temb, mods = _modulations(model, t)
    h = _run(model, model.x_embedder(img), model.context_embedder(txt), mods, rope)
    return _velocity(model, h[:, :n_img], temb)


def prefill(model: Flux2Transformer, ref, ref_rope) -> ReferenceKV:
    """Reference keys/values for ref tokens float[R, C] (all references concatenated)."""
    _, (img_mod, _, single_mod) = _modulations(model, jnp.zeros((1,), jnp.float32))
    h = model.x_embedder(ref[None].astype(model.x_embedder.dtype))

    def double(block, x, _):
        x, _, (k, v) = block(x, None, img_mod, None, ref_rope, _full)
        return x, (k[0], v[0])

    h, (double_k, double_v) = _scan(model, model.transformer_blocks, double, h)

    def single(block, x, _):
        x, (k, v) = block(x, single_mod, ref_rope, _full)
        return x, (k[0], v[0])

    _, (single_k, single_v) = _scan(model, model.single_transformer_blocks, single, h)
    # Split along the reference tokens (context) and heads (tensor): no device holds the whole cache.
    return ReferenceKV(*(constrain(a, REFERENCE_KV) for a in (double_k, double_v, single_k, single_v)))


def _with_cached(n_txt: int):
    """Attend over keys [txt, cached ref, img] for a joint sequence [txt, img]."""

    def make(layer_kv):
        k_ref, v_ref = layer_kv

        def attend(q, k, v):
            shape = (q.shape[0], *k_ref.shape)
            k = jnp.concatenate([k[:, :n_txt], jnp.broadcast_to(k_ref, shape), k[:, n_txt:]], axis=1)
            v = jnp.concatenate([v[:, :n_txt], jnp.broadcast_to(v_ref, shape), v[:, n_txt:]], axis=1)
            return attention(q, k, v)

        return attend

    return make


def forward_cached(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, kv: ReferenceKV):
    """Velocity float[B, N, C] with the references' cached keys/values (from `prefill`)."""
    temb, mods = _modulations(model, t)
    h = _run(
        model,
        model.x_embedder(img),
        model.context_embedder(txt),
        mods,
        concat_tables(txt_rope, img_rope),
        attend=_with_cached(txt.shape[1]),
        kv=((kv.double_k, kv.double_v), (kv.single_k, kv.single_v)),
    )
    return _velocity(model, h, temb)


def forward_kv_uncached(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, ref, ref_rope):
    """KV semantics in one pass over [txt, ref, img]: reference tokens modulated at t = 0 and
    attending only to themselves. Returns the velocity of the image tokens float[B, N, C]."""
    b, n_txt, n_ref = img.shape[0], txt.shape[1], ref.shape[0]
    temb, (img_mod, txt_mod, single_mod) = _modulations(model, t)
    _, (ref_img_mod, _, ref_single_mod) = _modulations(model, jnp.zeros((1,), jnp.float32))

    def per_token(*parts):
        return jnp.concatenate([jnp.broadcast_to(m, (b, n, m.shape[-1])) for m, n in parts], axis=1)

    n_img = img.shape[1]
    img_mod = per_token((ref_img_mod, n_ref), (img_mod, n_img))
    single_mod = per_token((single_mod, n_txt), (ref_single_mod, n_ref), (single_mod, n_img))
    total = n_txt + n_ref + n_img
    is_ref = (jnp.arange(total) >= n_txt) & (jnp.arange(total) < n_txt + n_ref)
    # Reference queries see only reference keys; text and image queries see everything.
    mask = (~is_ref[:, None]) | is_ref[None, :]

    def attend(_layer_kv):
        return lambda q, k, v: attention(q, k, v, mask[None, None])

    tokens = jnp.concatenate([jnp.broadcast_to(ref[None], (b, *ref.shape)), img], axis=1)
    rope = concat_tables(txt_rope, ref_rope, img_rope)
    mods = (img_mod, txt_mod, single_mod)
    h = _run(model, model.x_embedder(tokens), model.context_embedder(txt), mods, rope, attend=attend)
    return _velocity(model, h[:, n_ref:], temb)
