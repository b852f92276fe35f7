"""The FLUX.2 [klein] transformer and the ways to run it.

Axes: B batch, N image tokens, R reference tokens (all references of a request, concatenated),
T text tokens, S joint tokens ([txt, img] and whatever rides with the image stream), C token channels
(128), J text-embedding width, D model width, L layers, H heads, Dh head dim; inside the model a
count includes its stream's padding (see below). Rope tables are (cos, sin) float32[tokens, Dh] from
`rope.rope_tables`.

Ways to run (explicit functions, no mode strings):
- `forward`: text-to-image, or standard editing with `refs` appended after the image tokens,
  modulated at the current timestep, full attention (klein-4b / 9b / base);
- `prefill` + `forward_cached`: KV editing (klein-9b-kv). The prefill runs the reference tokens
  alone, modulated at t = 0 and attending only to themselves, and returns every layer's reference
  keys and values. Those depend on nothing but the references, so one `ReferenceKV` (no batch axis)
  serves every image of a batch, every step and every later request with the same references.
- `forward_kv_uncached`: the same KV semantics in one pass over [txt, ref, img] with per-token
  modulation, the reference tokens attending only to themselves (how the reference implementation runs
  step 0); a check on the cache.

The three forwards differ only in what their two token streams hold, how they are modulated and what
the queries see; each prepares those and hands them to one trunk, `_velocity`, which reads top to bottom
like BFL's flux2 model: input embeddings, the double blocks, the single blocks over [txt, img], the final
layer. Two steps differ from it. The last single block is a step of its own (`_last_single_block`): it
computes queries, MLP and output projection for the image rows the velocity reads alone. And what a
layer's queries see is data (`_Keys`: key ranks, an isolated span, cached reference keys and values)
that one attention function (`_attend`) reads. The prefill runs the same sequence over the references
alone, keeping every layer's keys and values instead (its last block computes those alone).

Layers are stacked and run one at a time (`klein.models.stacks`): compile time does not grow with depth,
and the stacks are sliced inside the loop, never copied.

Under context parallelism (a mesh in JAX's context) each token stream (text, image + references,
references alone) is padded with zero tokens to a multiple of the `context` size, so that it splits
over the devices whatever its length; padded keys rank `MASKED` (no query sees them) and padded outputs
are dropped, so the result is that of one device.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from klein.models import stacks
from klein.models.attention import MASKED, attention, isolated_span_attention
from klein.models.blocks import DoubleBlock, SingleBlock
from klein.models.layers import AdaNormOut, Modulation, TimeGuidanceEmbed, linear
from klein.models.rope import concat_tables
from klein.models.transformer_config import TransformerConfig
from klein.sharding import REFERENCE_KV, TOKENS, constrain, ways


class ReferenceKV(NamedTuple):
    """Per-layer keys and values of the reference tokens, after QK-norm and RoPE. No batch axis. Stacks in
    their stored form (bf16 as its bits, `klein.models.stacks`).

    R counts the padding a context-parallel prefill adds (see the module docstring); `key_rank` then
    ranks it `MASKED` (int32[1, R], 0 for the references), and is None where there is none."""

    double_k: jnp.ndarray  # [L_double, R, H, Dh]
    double_v: jnp.ndarray
    single_k: jnp.ndarray  # [L_single, R, H, Dh]
    single_v: jnp.ndarray
    key_rank: jnp.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.double_k.shape[1]

    @property
    def arrays(self) -> tuple[jnp.ndarray, ...]:
        return self.double_k, self.double_v, self.single_k, self.single_v


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


def forward(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, refs=None):
    """Velocity float[B, N, C] for image tokens img float[B, N, C], text txt float[B, T, J], t float[B].

    refs: optional (tokens float[B or 1, R, C], rope) appended after the image tokens (standard editing).
    """
    n_img = img.shape[1]
    if refs is not None:
        img, img_rope = _append(img, img_rope, refs)
    temb, mods = _modulations(model, t)
    text, image = _pad_stream(txt, txt_rope), _pad_stream(img, img_rope)
    keys = _Keys(_key_rank(text, image))
    return _velocity(model, temb, mods, text, image, keys, (text.tokens.shape[1], n_img))


def forward_cached(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, kv: ReferenceKV):
    """Velocity float[B, N, C] with the references' cached keys/values (from `prefill`): every layer
    attends over the keys [txt, cached ref, img]."""
    temb, mods = _modulations(model, t)
    text, image = _pad_stream(txt, txt_rope), _pad_stream(img, img_rope)
    keys = _Keys(_cached_key_rank(text, image, kv), cached_at=text.tokens.shape[1])
    return _velocity(model, temb, mods, text, image, keys, (text.tokens.shape[1], img.shape[1]), kv)


def prefill(model: Flux2Transformer, ref, ref_rope) -> ReferenceKV:
    """Reference keys/values for ref tokens float[R, C] (all references concatenated)."""
    _, (img_mod, _, single_mod) = _modulations(model, jnp.zeros((1,), jnp.float32))
    refs = _pad_stream(ref[None], ref_rope)
    keys = _Keys(_key_rank(refs))

    x = model.x_embedder(refs.tokens.astype(model.x_embedder.dtype))
    x, double_kv = _prefill_double_blocks(model, x, img_mod, refs.rope, keys)
    x, single_kv = _prefill_single_blocks(model, x, single_mod, refs.rope, keys)
    single_kv = _prefill_last_single_block(model, x, single_mod, refs.rope, single_kv)
    # Split along the reference tokens (context) and heads (tensor): no device holds the whole cache.
    return ReferenceKV(*(constrain(a, REFERENCE_KV) for a in (*double_kv, *single_kv)), keys.rank)


def forward_kv_uncached(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, ref, ref_rope):
    """KV semantics in one pass over [txt, ref, img]: reference tokens modulated at t = 0 and
    attending only to themselves. Returns the velocity of the image tokens float[B, N, C]."""
    b, n_ref, n_img = img.shape[0], ref.shape[0], img.shape[1]
    temb, (img_mod, txt_mod, single_mod) = _modulations(model, t)
    _, (ref_img_mod, _, ref_single_mod) = _modulations(model, jnp.zeros((1,), jnp.float32))
    tokens = jnp.concatenate([jnp.broadcast_to(ref[None], (b, *ref.shape)), img], axis=1)
    text, image = _pad_stream(txt, txt_rope), _pad_stream(tokens, concat_tables(ref_rope, img_rope))
    n_txt, n_rest = text.tokens.shape[1], image.tokens.shape[1] - n_ref  # n_rest: image and padding
    img_mod = _per_token(b, (ref_img_mod, n_ref), (img_mod, n_rest))
    single_mod = _per_token(b, (single_mod, n_txt), (ref_single_mod, n_ref), (single_mod, n_rest))
    # Reference queries see only reference keys; text and image queries see everything.
    keys = _Keys(_key_rank(text, image), isolated=(n_txt, n_txt + n_ref))
    mods = (img_mod, txt_mod, single_mod)
    return _velocity(model, temb, mods, text, image, keys, (n_txt + n_ref, n_img))


def _velocity(model, temb, mods, text: _Padded, image: _Padded, keys, rows, kv: ReferenceKV | None = None):
    """The velocity float[B, count, C] of the joint rows `rows` = (first, count), the image tokens: the
    input embeddings of both streams, the double blocks, the single blocks over [txt, img], the last
    single block over those rows, the final layer. `mods` = (img_mod, txt_mod, single_mod); `keys`: what
    the queries see; `kv`: the references' cached keys and values, a layer of them spliced into each
    layer's, or None."""
    img_mod, txt_mod, single_mod = mods
    rope = concat_tables(text.rope, image.rope)
    double_kv = None if kv is None else (kv.double_k, kv.double_v)
    single_kv = None if kv is None else (kv.single_k, kv.single_v)

    img, txt = model.x_embedder(image.tokens), model.context_embedder(text.tokens)
    img, txt = _double_blocks(model, img, txt, (img_mod, txt_mod), rope, keys, double_kv)
    x = _single_blocks(model, jnp.concatenate([txt, img], axis=1), single_mod, rope, keys, single_kv)
    last = None if kv is None else stacks.layer(single_kv, model.cfg.num_single_layers - 1)
    # The last block's queries are image tokens only, which see every key.
    x = _last_single_block(model, x, single_mod, rope, keys._replace(isolated=None, cached=last), rows)
    return _final_layer(model, x, temb)


def _modulations(model, t):
    """The timestep embedding float[B, D] and the model-wide modulations it gives: the double blocks'
    image and text streams, the single blocks."""
    temb = model.time_guidance_embed(t)
    return temb, (
        model.double_stream_modulation_img(temb),
        model.double_stream_modulation_txt(temb),
        model.single_stream_modulation(temb),
    )


def _double_blocks(model, img, txt, mods, rope, keys, cached=None):
    """The double blocks over the image stream img float[B, N, D] (references ride in it) and the text
    stream txt float[B, T, D], mods = (img_mod, txt_mod); `cached`: the references' (k, v) stacks
    [L_double, R, H, Dh], a layer each, or None."""
    img_mod, txt_mod = mods

    def body(block, streams, layer_kv):
        attend = partial(_attend, keys=keys._replace(cached=layer_kv))
        img, txt, _ = block(*streams, img_mod, txt_mod, rope, attend)
        return (img, txt), None

    (img, txt), _ = _scan(model.transformer_blocks, body, (img, txt), model.cfg.num_layers, cached)
    return img, txt


def _single_blocks(model, x, mod, rope, keys, cached=None):
    """Every single block but the last (`_last_single_block`) over x float[B, S, D]; `cached`: the
    references' (k, v) stacks [L_single, R, H, Dh], a layer each, or None."""

    def body(block, x, layer_kv):
        attend = partial(_attend, keys=keys._replace(cached=layer_kv))
        return block(x, mod, rope, attend)[0], None

    x, _ = _scan(model.single_transformer_blocks, body, x, model.cfg.num_single_layers - 1, cached)
    return x


def _last_single_block(model, x, mod, rope, keys, rows: tuple[int, int]):
    """The last single block's output float[B, count, D] for the joint rows `rows` = (first, count) only,
    the image tokens the velocity is read from: queries, MLP and output projection run over those rows
    (widened to a multiple of the context size), keys and values over every token (`SingleBlock.rows`)."""
    first, count = rows
    start, stop = _covering(first, count, x.shape[1], _context_ways())
    block = _block(model.single_transformer_blocks, model.cfg.num_single_layers - 1)
    h = block.rows(constrain(x, TOKENS), mod, rope, partial(_attend, keys=keys), start, stop)
    return h[:, first - start : first - start + count]


def _covering(first: int, count: int, total: int, multiple: int) -> tuple[int, int]:
    """Joint rows [start, stop) holding [first, first + count), as many as a multiple of `multiple`
    (context parallelism splits the queries evenly) and within the `total` rows of the sequence."""
    size = min(-(-count // multiple) * multiple, total)
    start = min(first, total - size)
    return start, start + size


def _final_layer(model, x, temb):
    """The velocity float[B, N, C] of the image tokens' hidden states x float[B, N, D]."""
    return model.proj_out(model.norm_out(x, temb))


def _prefill_double_blocks(model, x, mod, rope, keys):
    """The double blocks over the references alone (no text stream): x and every layer's (k, v),
    stacked in their stored form [L_double, R, H, Dh]."""

    def body(block, x, _):
        x, _, (k, v) = block(x, None, mod, None, rope, partial(_attend, keys=keys))
        return x, (stacks.as_bits(k[0]), stacks.as_bits(v[0]))

    return _scan(model.transformer_blocks, body, x, model.cfg.num_layers)


def _prefill_single_blocks(model, x, mod, rope, keys):
    """Every single block but the last over the references: x and the (k, v) stacks [L_single, R, H, Dh]
    their keys and values were written straight into, the last layer still empty."""
    cfg, count = model.cfg, model.cfg.num_single_layers - 1
    layer = (x.shape[1], cfg.num_attention_heads, cfg.attention_head_dim)
    empty = stacks.empty(cfg.num_single_layers, layer, x.dtype)

    def body(block, carry, index):
        x, ks, vs = carry
        x, (k, v) = block(x, mod, rope, partial(_attend, keys=keys))
        return (x, stacks.put(ks, index, k[0]), stacks.put(vs, index, v[0])), None

    blocks = model.single_transformer_blocks
    (x, ks, vs), _ = _scan(blocks, body, (x, empty, empty), count, jnp.arange(count))
    return x, (ks, vs)


def _prefill_last_single_block(model, x, mod, rope, kv):
    """The (k, v) stacks `kv` with the last single block's written in: it computes its keys and values
    alone (nothing reads its output); joining them to the others would copy the stacks."""
    last = model.cfg.num_single_layers - 1
    k, v = _block(model.single_transformer_blocks, last).keys_values(constrain(x, TOKENS), mod, rope)
    return stacks.put(kv[0], last, k[0]), stacks.put(kv[1], last, v[0])


def _scan(blocks, body, carry, count: int, xs=None):
    """Run `body(block, carry, layer_xs) -> (carry, ys)` over the first `count` blocks of a stack; `xs`
    are per-layer stacks (reference keys and values, layer indices) or None.

    The carry holds token streams float[B, S, D] (and, in the prefill, the key / value stacks it fills);
    pinning the streams' layout at every layer keeps batch and tokens split (data / context parallelism)
    instead of leaving it to propagation.
    """
    graphdef, params = nnx.split(blocks)

    def step(carry, layers):
        layer_params, layer_xs = layers
        carry = jax.tree.map(lambda x: constrain(x, TOKENS) if x.ndim == 3 else x, carry)
        return body(nnx.merge(graphdef, layer_params), carry, layer_xs)

    return stacks.scan(step, carry, (params, xs), count)


def _block(blocks, index: int):
    """Block `index` of a stack, as a module of its own."""
    graphdef, params = nnx.split(blocks)
    return nnx.merge(graphdef, stacks.layer(params, index))


class _Keys(NamedTuple):
    """What a layer's queries see, as data for `_attend`.

    rank: int32[1, keys], 0 for a key and `MASKED` for padding; None when nothing is padded (the
    unmasked kernel). isolated: joint tokens [start, stop) that see only each other (the references of
    `forward_kv_uncached`), or None. cached: one layer's reference (k, v) float[R, H, Dh], spliced into
    the keys and values after the first `cached_at` joint tokens (the text), or None."""

    rank: jnp.ndarray | None = None
    isolated: tuple[int, int] | None = None
    cached: tuple[jnp.ndarray, jnp.ndarray] | None = None
    cached_at: int = 0


def _attend(q, k, v, keys: _Keys):
    """Attention of queries q float[B, Sq, H, Dh] over the joint keys and values k, v float[B, S, H, Dh]
    (and the cached ones) as `keys` says."""
    if keys.cached is not None:
        k, v = (_splice(x, cached, keys.cached_at) for x, cached in zip((k, v), keys.cached, strict=True))
    if keys.isolated is not None:
        return isolated_span_attention(q, k, v, *keys.isolated, keys.rank)
    if keys.rank is None:
        return attention(q, k, v)
    return attention(q, k, v, jnp.zeros((1, q.shape[1]), jnp.int32), keys.rank)


def _splice(x, cached, at: int):
    """x float[B, S, H, Dh] with cached float[R, H, Dh] (the same for every image) after its first `at`
    tokens."""
    cached = jnp.broadcast_to(cached, (x.shape[0], *cached.shape))
    return jnp.concatenate([x[:, :at], cached, x[:, at:]], axis=1)


def _context_ways() -> int:
    """Devices the token streams split over in the mesh of JAX's context (1 without one)."""
    return ways(jax.sharding.get_abstract_mesh(), "seq")


class _Padded(NamedTuple):
    """A token stream padded to a multiple of the context size: tokens [B, S', ...], rope [S', Dh],
    rank int32[S'] (0 for its tokens, MASKED for the padding), and `real` = S."""

    tokens: jnp.ndarray
    rope: tuple
    rank: jnp.ndarray
    real: int


def _pad_stream(tokens, rope) -> _Padded:
    real = tokens.shape[1]
    extra = -real % _context_ways()
    rank = jnp.concatenate([jnp.zeros(real, jnp.int32), jnp.full(extra, MASKED, jnp.int32)])
    return _Padded(_pad_tokens(tokens, extra), tuple(_pad_tokens(t, extra, 0) for t in rope), rank, real)


def _pad_tokens(x, extra: int, axis: int = 1):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths) if extra else x


def _key_rank(*streams: _Padded):
    """int32[1, S] over the concatenated streams, or None when none is padded (the unmasked kernel)."""
    if all(s.tokens.shape[1] == s.real for s in streams):
        return None
    return jnp.concatenate([s.rank for s in streams])[None]


def _cached_key_rank(text: _Padded, image: _Padded, kv: ReferenceKV):
    """int32[1, T + R + N] over the keys [txt, cached ref, img], or None when none is padded."""
    if kv.key_rank is None and _key_rank(text, image) is None:
        return None
    ref_rank = kv.key_rank if kv.key_rank is not None else jnp.zeros((1, kv.num_tokens), jnp.int32)
    return jnp.concatenate([text.rank[None], ref_rank, image.rank[None]], axis=1)


def _append(img, img_rope, refs):
    """The image tokens and rope with the references' appended (standard editing)."""
    ref_tokens, ref_rope = refs
    ref_tokens = jnp.broadcast_to(ref_tokens, (img.shape[0], *ref_tokens.shape[1:]))
    return jnp.concatenate([img, ref_tokens.astype(img.dtype)], axis=1), concat_tables(img_rope, ref_rope)


def _per_token(batch: int, *parts):
    """Per-token modulation float[B, S, M] from (modulation float[B or 1, 1, M], count) parts, in order."""
    return jnp.concatenate([jnp.broadcast_to(m, (batch, n, m.shape[-1])) for m, n in parts], axis=1)
