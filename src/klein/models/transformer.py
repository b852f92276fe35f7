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
  modulation, the reference tokens attending only to themselves (how the reference implementation runs
  step 0); a check on the cache.

Layers are stacked and run one at a time (`klein.models.stacks`): compile time does not grow with depth,
and the stacks are sliced inside the loop, never copied.

Under context parallelism (a mesh in JAX's context) each token stream (text, image + references,
references alone) is padded with zero tokens to a multiple of the `context` size, so that it splits
over the devices whatever its length; padded keys rank `MASKED` (no query sees them) and padded outputs
are dropped, so the result is that of one device.
"""

from __future__ import annotations

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


def _scan(blocks, body, carry, count: int, xs=None):
    """Run `body(block, carry, layer_xs) -> (carry, ys)` over the first `count` blocks of a stack; `xs`
    are per-layer stacks (reference keys and values) or None.

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


def _into(stack, kv, index):
    """`stack` with layer `index` set to one block's keys or values float[1, R, H, Dh], as bits."""
    return jax.lax.dynamic_update_index_in_dim(stack, stacks.as_bits(kv[0]), index, 0)


def _block(blocks, index: int):
    """Block `index` of a stack, as a module of its own."""
    graphdef, params = nnx.split(blocks)
    return nnx.merge(graphdef, stacks.layer(params, index))


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


def _pad_stream(tokens, rope, multiple: int) -> _Padded:
    real = tokens.shape[1]
    extra = -real % multiple
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


def _masking(k_rank):
    """`attend` for a layer: full attention, except to the padded keys `k_rank` marks."""
    if k_rank is None:
        return _always_full

    def attend(q, k, v):
        return attention(q, k, v, jnp.zeros((1, q.shape[1]), jnp.int32), k_rank)

    return lambda _layer_kv: attend


def _run(model, img, txt, mods, rope, rows, attend=_always_full, kv=None, last_attend=None):
    """Double then single blocks over [txt, img]; returns the hidden states float[B, count, D] of the
    image-stream tokens `rows` = (first, count), the only ones the caller reads.

    `mods` may be per token (see `forward_kv_uncached`). `attend(layer_kv)` gives each layer's
    attention; `kv` is the per-layer input it gets ((double, single) stacks, or None). The last single
    block computes queries, MLP and output projection for the kept rows alone (`SingleBlock.rows`);
    `last_attend` is its attention where `attend` assumes queries over the whole sequence.
    """
    img_mod, txt_mod, single_mod = mods
    kv_double, kv_single = kv if kv is not None else (None, None)

    def double(block, carry, layer_kv):
        img, txt = carry
        img, txt, _ = block(img, txt, img_mod, txt_mod, rope, attend(layer_kv))
        return (img, txt), None

    doubles, last = model.cfg.num_layers, model.cfg.num_single_layers - 1
    (img, txt), _ = _scan(model.transformer_blocks, double, (img, txt), doubles, kv_double)

    def single(block, x, layer_kv):
        return block(x, single_mod, rope, attend(layer_kv))[0], None

    blocks = model.single_transformer_blocks
    x, _ = _scan(blocks, single, jnp.concatenate([txt, img], 1), last, kv_single)
    first = txt.shape[1] + rows[0]
    start, stop = _covering(first, rows[1], x.shape[1], _context_ways())
    last_attend = last_attend or attend(None if kv_single is None else stacks.layer(kv_single, last))
    h = _block(blocks, last).rows(constrain(x, TOKENS), single_mod, rope, last_attend, start, stop)
    return h[:, first - start : first - start + rows[1]]


def _covering(first: int, count: int, total: int, multiple: int) -> tuple[int, int]:
    """Joint rows [start, stop) holding [first, first + count), as many as a multiple of `multiple`
    (context parallelism splits the queries evenly) and within the `total` rows of the sequence."""
    size = min(-(-count // multiple) * multiple, total)
    start = min(first, total - size)
    return start, start + size


def _velocity(model, h, temb):
    return model.proj_out(model.norm_out(h, temb))


def forward(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, refs=None):
    """Velocity float[B, N, C] for image tokens img float[B, N, C], text txt float[B, T, J], t float[B].

    refs: optional (tokens float[B or 1, R, C], rope) appended after the image tokens (standard editing).
    """
    n_img = img.shape[1]
    if refs is not None:
        ref_tokens, ref_rope = refs
        ref_tokens = jnp.broadcast_to(ref_tokens, (img.shape[0], *ref_tokens.shape[1:]))
        img = jnp.concatenate([img, ref_tokens.astype(img.dtype)], axis=1)
        img_rope = concat_tables(img_rope, ref_rope)
    context = _context_ways()
    text, image = _pad_stream(txt, txt_rope, context), _pad_stream(img, img_rope, context)
    temb, mods = _modulations(model, t)
    h = _run(
        model,
        model.x_embedder(image.tokens),
        model.context_embedder(text.tokens),
        mods,
        concat_tables(text.rope, image.rope),
        (0, n_img),
        attend=_masking(_key_rank(text, image)),
    )
    return _velocity(model, h, temb)


def prefill(model: Flux2Transformer, ref, ref_rope) -> ReferenceKV:
    """Reference keys/values for ref tokens float[R, C] (all references concatenated)."""
    _, (img_mod, _, single_mod) = _modulations(model, jnp.zeros((1,), jnp.float32))
    refs = _pad_stream(ref[None], ref_rope, _context_ways())
    h = model.x_embedder(refs.tokens.astype(model.x_embedder.dtype))
    attend = _masking(_key_rank(refs))(None)

    def double(block, x, _):
        x, _, (k, v) = block(x, None, img_mod, None, refs.rope, attend)
        return x, (stacks.as_bits(k[0]), stacks.as_bits(v[0]))

    h, (double_k, double_v) = _scan(model.transformer_blocks, double, h, model.cfg.num_layers)

    # The single blocks' keys and values go straight into their stacks, the last block's too: it computes
    # its keys and values alone (its output is never read), and joining it to the others would copy them.
    blocks, last = model.single_transformer_blocks, model.cfg.num_single_layers - 1
    cfg = model.cfg
    shape = (last + 1, h.shape[1], cfg.num_attention_heads, cfg.attention_head_dim)
    empty = jnp.zeros(shape, stacks.as_bits(h[:0]).dtype)

    def single(block, carry, index):
        x, ks, vs = carry
        x, (k, v) = block(x, single_mod, refs.rope, attend)
        return (x, _into(ks, k, index), _into(vs, v, index)), None

    (h, single_k, single_v), _ = _scan(blocks, single, (h, empty, empty), last, jnp.arange(last))
    last_k, last_v = _block(blocks, last).keys_values(constrain(h, TOKENS), single_mod, refs.rope)
    single_k, single_v = _into(single_k, last_k, last), _into(single_v, last_v, last)
    # Split along the reference tokens (context) and heads (tensor): no device holds the whole cache.
    arrays = (constrain(a, REFERENCE_KV) for a in (double_k, double_v, single_k, single_v))
    return ReferenceKV(*arrays, _key_rank(refs))


def _with_cached(text: _Padded, image: _Padded, kv: ReferenceKV):
    """Attend over keys [txt, cached ref, img] for a joint sequence [txt, img]."""
    n_txt = text.tokens.shape[1]
    ref_rank = kv.key_rank if kv.key_rank is not None else jnp.zeros((1, kv.num_tokens), jnp.int32)
    k_rank = None
    if kv.key_rank is not None or _key_rank(text, image) is not None:
        k_rank = jnp.concatenate([text.rank[None], ref_rank, image.rank[None]], axis=1)

    def make(layer_kv):
        k_ref, v_ref = layer_kv

        def attend(q, k, v):
            shape = (q.shape[0], *k_ref.shape)
            k = jnp.concatenate([k[:, :n_txt], jnp.broadcast_to(k_ref, shape), k[:, n_txt:]], axis=1)
            v = jnp.concatenate([v[:, :n_txt], jnp.broadcast_to(v_ref, shape), v[:, n_txt:]], axis=1)
            if k_rank is None:
                return attention(q, k, v)
            return attention(q, k, v, jnp.zeros((1, q.shape[1]), jnp.int32), k_rank)

        return attend

    return make


def forward_cached(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, kv: ReferenceKV):
    """Velocity float[B, N, C] with the references' cached keys/values (from `prefill`)."""
    context = _context_ways()
    text, image = _pad_stream(txt, txt_rope, context), _pad_stream(img, img_rope, context)
    temb, mods = _modulations(model, t)
    h = _run(
        model,
        model.x_embedder(image.tokens),
        model.context_embedder(text.tokens),
        mods,
        concat_tables(text.rope, image.rope),
        (0, img.shape[1]),
        attend=_with_cached(text, image, kv),
        kv=((kv.double_k, kv.double_v), (kv.single_k, kv.single_v)),
    )
    return _velocity(model, h, temb)


def forward_kv_uncached(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, ref, ref_rope):
    """KV semantics in one pass over [txt, ref, img]: reference tokens modulated at t = 0 and
    attending only to themselves. Returns the velocity of the image tokens float[B, N, C]."""
    b, n_ref, n_img = img.shape[0], ref.shape[0], img.shape[1]
    temb, (img_mod, txt_mod, single_mod) = _modulations(model, t)
    _, (ref_img_mod, _, ref_single_mod) = _modulations(model, jnp.zeros((1,), jnp.float32))
    context = _context_ways()
    tokens = jnp.concatenate([jnp.broadcast_to(ref[None], (b, *ref.shape)), img], axis=1)
    text = _pad_stream(txt, txt_rope, context)
    image = _pad_stream(tokens, concat_tables(ref_rope, img_rope), context)
    n_txt, pad = text.tokens.shape[1], image.tokens.shape[1] - image.real

    def per_token(*parts):
        return jnp.concatenate([jnp.broadcast_to(m, (b, n, m.shape[-1])) for m, n in parts], axis=1)

    img_mod = per_token((ref_img_mod, n_ref), (img_mod, n_img + pad))
    single_mod = per_token((single_mod, n_txt), (ref_single_mod, n_ref), (single_mod, n_img + pad))
    k_rank = _key_rank(text, image)

    def attend(_layer_kv):
        # Reference queries see only reference keys; text and image queries see everything.
        return lambda q, k, v: isolated_span_attention(q, k, v, n_txt, n_txt + n_ref, k_rank)

    rope = concat_tables(text.rope, image.rope)
    mods = (img_mod, txt_mod, single_mod)
    img_h, txt_h = model.x_embedder(image.tokens), model.context_embedder(text.tokens)
    # The last block's queries are image tokens only, which see every key.
    image_attend = _masking(k_rank)(None)
    h = _run(model, img_h, txt_h, mods, rope, (n_ref, n_img), attend, last_attend=image_attend)
    return _velocity(model, h, temb)
