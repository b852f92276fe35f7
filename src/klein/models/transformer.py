"""The FLUX.2 [klein] transformer and the ways to run it: `forward` (text-to-image and standard editing),
`prefill` + `forward_cached` (KV editing) and `forward_kv_uncached` (the same KV semantics in one pass, a
check on the cache). Each prepares its two token streams, their modulation and what the queries see
(`attention.Keys`), and hands them to one trunk (`_velocity`, `_layers`); layers run one at a time from
their stacks (`klein.models.stacks`). See docs/design/requests.md, "KV cache"; axes as in `klein.models`.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from klein.models import attention, reference_kv8, stacks, step_cache
from klein.models.attention import Keys, Padded, key_rank, padded, stream_rank
from klein.models.blocks import DoubleBlock, SingleBlock
from klein.models.layers import AdaNormOut, Linear, Modulation, TimeGuidanceEmbed
from klein.models.rope import concat_tables
from klein.models.transformer_config import TransformerConfig
from klein.sharding import REFERENCE_KV, TOKENS, constrain, covering


class ReferenceKV(NamedTuple):
    """Per-layer keys and values of the reference tokens, after QK-norm and RoPE. No batch axis. Stacks in
    their stored form (bf16 as its bits, `klein.models.stacks`).

    R counts the padding of the references' token bucket and what a context-parallel prefill adds
    (`attention.padded`); `key_rank` then ranks it `MASKED` (int32[1, R], 0 for the references), and is
    None where there is none.

    `scales`: None, or the keys and values are int8 (`klein.models.reference_kv8`), each stack with its
    scales float32[L, H] (double k, double v, single k, single v)."""

    double_k: jnp.ndarray  # [L_double, R, H, Dh]
    double_v: jnp.ndarray
    single_k: jnp.ndarray  # [L_single, R, H, Dh]
    single_v: jnp.ndarray
    key_rank: jnp.ndarray | None = None
    scales: tuple | None = None

    @property
    def kv_dtype(self) -> str | None:
        """`reference_kv8.INT8` for 8-bit keys and values, else None (the compute dtype's)."""
        return None if self.scales is None else reference_kv8.INT8

    def stacks(self) -> tuple:
        """(double (k, v), single (k, v)) as the layers read them: stacks, or (stack, scales) pairs."""
        if self.scales is None:
            return (self.double_k, self.double_v), (self.single_k, self.single_v)
        pairs = tuple(zip(self.arrays, self.scales, strict=True))
        return pairs[:2], pairs[2:]

    @property
    def num_tokens(self) -> int:
        return self.double_k.shape[1]

    @property
    def arrays(self) -> tuple[jnp.ndarray, ...]:
        return self.double_k, self.double_v, self.single_k, self.single_v


class Flux2Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d = cfg.hidden
        self.cfg = cfg
        self.time_guidance_embed = TimeGuidanceEmbed(cfg.timestep_guidance_channels, d, rngs, dtype)
        self.double_stream_modulation_img = Modulation(d, 2, rngs, dtype)
        self.double_stream_modulation_txt = Modulation(d, 2, rngs, dtype)
        self.single_stream_modulation = Modulation(d, 1, rngs, dtype)
        self.x_embedder = Linear(cfg.in_channels, d, rngs, dtype)
        self.context_embedder = Linear(cfg.joint_attention_dim, d, rngs, dtype)
        self.transformer_blocks = stacks.stack(lambda r: DoubleBlock(cfg, r, dtype), cfg.num_layers, rngs)
        self.single_transformer_blocks = stacks.stack(
            lambda r: SingleBlock(cfg, r, dtype), cfg.num_single_layers, rngs
        )
        self.norm_out = AdaNormOut(d, cfg.eps, rngs, dtype)
        self.proj_out = Linear(d, cfg.in_channels, rngs, dtype)


def forward(
    model: Flux2Transformer,
    img,
    txt,
    t,
    img_rope,
    txt_rope,
    refs=None,
    cache=None,
    img_rank=None,
    ref_rank=None,
):
    """Velocity float[B, N, C] for image tokens img float[B, N, C], text txt float[B, T, J], t float[B].

    refs: optional (tokens float[B or 1, R, C], rope) appended after the image tokens (standard editing).
    img_rank, ref_rank: None, or int32[N] / int32[R], 0 for a token and `attention.MASKED` for the
    padding of a token bucket (`klein.models.buckets`), which no token sees.
    cache: None, or a step cache (`Cached`): then (velocity, (its state after this step, Records)).
    """
    n_img, rank = img.shape[1], img_rank
    if refs is not None:
        ref_tokens, ref_rope = refs
        ref_tokens = jnp.broadcast_to(ref_tokens, (img.shape[0], *ref_tokens.shape[1:])).astype(img.dtype)
        rank = _joined_rank((img_rank, n_img), (ref_rank, ref_tokens.shape[1]))
        img, img_rope = jnp.concatenate([img, ref_tokens], axis=1), concat_tables(img_rope, ref_rope)
    temb, mods = _modulations(model, t)
    text, image = padded(txt, txt_rope), padded(img, img_rope, rank)
    keys = Keys(key_rank(text, image))
    return _velocity(model, temb, mods, text, image, keys, (text.tokens.shape[1], n_img), cache=cache)


def forward_cached(
    model: Flux2Transformer, img, txt, t, img_rope, txt_rope, kv: ReferenceKV, cache=None, img_rank=None
):
    """Velocity float[B, N, C] with the references' cached keys/values (from `prefill`): every layer
    attends over the keys [txt, cached ref, img]. `cache` and `img_rank` as `forward`'s."""
    temb, mods = _modulations(model, t)
    text, image = padded(txt, txt_rope), padded(img, img_rope, img_rank)
    keys = Keys(_cached_key_rank(text, image, kv), cached_at=text.tokens.shape[1])
    return _velocity(model, temb, mods, text, image, keys, (text.tokens.shape[1], img.shape[1]), kv, cache)


class Cached(NamedTuple):
    """A step cache for one pass (`klein.models.step_cache`): its structure (static), the state of its
    two groups (double, single; or `step_cache.PROBE`) and the step's settings."""

    structure: step_cache.Structure
    state: tuple | str
    knobs: step_cache.Knobs


def prefill(
    model: Flux2Transformer, ref, ref_rope, ref_rank=None, kv_dtype: str | None = None
) -> ReferenceKV:
    """Reference keys/values for ref tokens float[R, C] (all references concatenated): the layers' walk
    over the references alone, recording each layer's keys and values. `ref_rank` as `forward`'s
    `img_rank`: the padding's keys and values are recorded and ranked `MASKED` in the result.
    `kv_dtype` "int8": recorded in 8 bits, the blocks run in pieces (`klein.models.reference_kv8`)."""
    _, mods = _modulations(model, jnp.zeros((1,), jnp.float32))
    refs = padded(ref[None], ref_rope, ref_rank)
    keys = Keys(key_rank(refs))
    x = model.x_embedder(refs.tokens.astype(model.x_embedder.dtype))
    quantised = kv_dtype == reference_kv8.INT8
    _, recorded = _layers(model, x, None, mods, refs.rope, keys, quantised=quantised)
    # Split along the reference tokens (context) and heads (tensor): no device holds the whole cache.
    if not quantised:
        return ReferenceKV(*(constrain(a, REFERENCE_KV) for a in recorded), keys.rank)
    values, scales = zip(*recorded, strict=True)
    return ReferenceKV(*(constrain(a, REFERENCE_KV) for a in values), keys.rank, tuple(scales))


def prefill_int8(model: Flux2Transformer, ref, ref_rope, ref_rank=None) -> ReferenceKV:
    """`prefill` of 8-bit keys and values (`klein.models.reference_kv8`): a program of its own."""
    return prefill(model, ref, ref_rope, ref_rank, reference_kv8.INT8)


def forward_kv_uncached(model: Flux2Transformer, img, txt, t, img_rope, txt_rope, ref, ref_rope):
    """KV semantics in one pass over [txt, ref, img]: reference tokens modulated at t = 0 and
    attending only to themselves. Returns the velocity of the image tokens float[B, N, C]."""
    b, n_ref, n_img = img.shape[0], ref.shape[0], img.shape[1]
    temb, (img_mod, txt_mod, single_mod) = _modulations(model, t)
    _, (ref_img_mod, _, ref_single_mod) = _modulations(model, jnp.zeros((1,), jnp.float32))
    tokens = jnp.concatenate([jnp.broadcast_to(ref[None], (b, *ref.shape)), img], axis=1)
    text, image = padded(txt, txt_rope), padded(tokens, concat_tables(ref_rope, img_rope))
    n_txt, n_rest = text.tokens.shape[1], image.tokens.shape[1] - n_ref  # n_rest: image and padding
    img_mod = _per_token(b, (ref_img_mod, n_ref), (img_mod, n_rest))
    single_mod = _per_token(b, (single_mod, n_txt), (ref_single_mod, n_ref), (single_mod, n_rest))
    # Reference queries see only reference keys; text and image queries see everything.
    keys = Keys(key_rank(text, image), isolated=(n_txt, n_txt + n_ref))
    return _velocity(model, temb, (img_mod, txt_mod, single_mod), text, image, keys, (n_txt + n_ref, n_img))


def _velocity(
    model, temb, mods, text: Padded, image: Padded, keys, rows, kv=None, cache: Cached | None = None
):
    """The velocity float[B, count, C] of the joint rows `rows` = (first, count), the image tokens: the
    input embeddings of both streams, the layers (`_layers`), the final layer; with a step `cache`,
    (velocity, what the cache gives)."""
    rope = concat_tables(text.rope, image.rope)
    img, txt = model.x_embedder(image.tokens), model.context_embedder(text.tokens)
    if cache is not None:
        cache = (cache, _real_tokens(image), _real_tokens(text, image))
    x, cached = _layers(model, img, txt, mods, rope, keys, rows, kv, cache)
    velocity = model.proj_out(model.norm_out(x, temb))
    return velocity if cache is None else (velocity, cached)


def _real_tokens(*streams: Padded):
    """float32[S] over the concatenated streams, 1 for their tokens and 0 for padding; None if none is padded."""
    rank = key_rank(*streams)
    return None if rank is None else (rank[0] == 0).astype(jnp.float32)


def _layers(
    model,
    img,
    txt,
    mods,
    rope,
    keys: Keys,
    rows=None,
    kv: ReferenceKV | None = None,
    cache=None,
    quantised=False,
):
    """The layer walk, one for every way to run it: the double blocks over the image stream img
    float[B, N, D] and the text stream txt float[B, T, D], the single blocks over [txt, img], the last
    single block. `mods` = (img_mod, txt_mod, single_mod); `keys`: what the queries see; `kv`: the
    references' cached keys and values (a layer of them spliced into each layer's), or None.

    The velocity reads the last block's output for the joint rows `rows` = (first, count), computed over
    those rows alone (`SingleBlock.rows`, `sharding.covering`): (float[B, count, D], None). The prefill
    (txt and rows None) records every layer's keys and values instead, written straight into stacks in
    their stored form (joining the last layer to the others would copy them): (None, (double k, double v
    [L_double, R, H, Dh], single k, single v [L_single, R, H, Dh])).

    `cache`: None, or (`Cached`, the real tokens of the image stream and of [txt, img] as `_real_tokens`):
    each group then runs through `step_cache.through`, and the second value is (the groups' states,
    their `Record`s).

    `quantised` (a prefill's): keys and values recorded in 8 bits with their scales, the blocks run in
    pieces (`klein.models.reference_kv8`); `kv`'s 8-bit ones are widened a layer at a time."""
    cfg, (img_mod, txt_mod, single_mod) = model.cfg, mods
    record, last = rows is None, cfg.num_single_layers - 1
    double_kv, single_kv = (None, None) if kv is None else kv.stacks()
    piece = reference_kv8.PREFILL_PIECE if quantised else None
    real = None if keys.rank is None else keys.rank[0] == 0  # the tokens whose magnitudes set the scales

    def widened(layer_kv):
        return reference_kv8.floats(layer_kv, img.dtype)

    def double(block, streams, layer_kv):
        attend = partial(attention.attend, keys=keys._replace(cached=widened(layer_kv)))
        img, txt, (k, v) = block(*streams, img_mod, txt_mod, rope, attend, piece)
        return (img, txt), (
            tuple(reference_kv8.record(a[0], real, quantised) for a in (k, v)) if record else None
        )

    def run_double(streams, start, stop):
        if start >= stop:
            return streams
        return _scan(model.transformer_blocks, double, streams, stop, double_kv, start)[0]

    if cache is None:
        (img, txt), double_kv = _scan(model.transformer_blocks, double, (img, txt), cfg.num_layers, double_kv)
    else:
        (cached, double_real, single_real), states = cache, []
        through = partial(step_cache.through, cached.structure, knobs=cached.knobs)

        def group(index, streams, run, count, reach, real):
            state = cached.state if cached.state is step_cache.PROBE else cached.state[index]
            streams, state, record = through(
                index, state, streams=streams, run=run, count=count, reach=reach, weights=real
            )
            states.append((state, record))
            return streams

        img, txt = group(step_cache.DOUBLE, (img, txt), run_double, cfg.num_layers, _whole, double_real)
    x = img if txt is None else jnp.concatenate([txt, img], axis=1)
    recorded = None
    if record:
        layer = (x.shape[1], cfg.num_attention_heads, cfg.attention_head_dim)
        recorded = (reference_kv8.empty(cfg.num_single_layers, layer, x.dtype, quantised),) * 2

    def put(recorded, index, k, v):
        return tuple(
            reference_kv8.put(r, index, a[0], real, quantised) for r, a in zip(recorded, (k, v), strict=True)
        )

    def single(block, carry, layer):
        (x, recorded), (layer_kv, index) = carry, layer
        attend = partial(attention.attend, keys=keys._replace(cached=widened(layer_kv)))
        if piece is None:
            x, (k, v) = block(x, single_mod, rope, attend)
        else:
            x, (k, v) = block.pieces(x, single_mod, rope, attend, piece)
        if record:
            recorded = put(recorded, index, k, v)
        return (x, recorded), None

    xs = (single_kv, jnp.arange(last) if record else None)
    block = _block(model.single_transformer_blocks, last)
    if record:
        (x, recorded), _ = _scan(model.single_transformer_blocks, single, (x, recorded), last, xs)
        k, v = block.keys_values(constrain(x, TOKENS), single_mod, rope)
        return None, (*double_kv, *put(recorded, last, k, v))
    # The last block's queries are image tokens only, which see every key.
    last_keys = keys._replace(
        isolated=None, cached=None if kv is None else widened(stacks.layer(single_kv, last))
    )
    first, count = rows
    start, stop = covering(first, count, x.shape[1])

    def run_single(streams, begin, end):
        """Single blocks [begin, end) over (x,); the last one gives the covering rows of the image."""
        if begin >= end:
            return streams
        (x,) = streams
        (x, _), _ = _scan(model.single_transformer_blocks, single, (x, None), min(end, last), xs, begin)
        if end <= last:
            return (x,)
        attend = partial(attention.attend, keys=last_keys)
        return (block.rows(constrain(x, TOKENS), single_mod, rope, attend, start, stop),)

    if cache is None:
        (h,) = run_single((x,), 0, cfg.num_single_layers)
        return h[:, first - start : first - start + count], None
    # Without blocks after the cached ones, what is kept is the last block's rows: those of the image.
    reach = _whole if cached.structure.compute_last else (lambda streams: (streams[0][:, start:stop],))
    (h,) = group(step_cache.SINGLE, (x,), run_single, cfg.num_single_layers, reach, single_real)
    (double_state, double_record), (single_state, single_record) = states
    records = (
        None if double_record is None else jax.tree.map(lambda *r: jnp.stack(r), double_record, single_record)
    )
    return h[:, first - start : first - start + count], ((double_state, single_state), records)


def _whole(streams):
    return streams


def _modulations(model, t):
    """The timestep embedding float[B, D] and the model-wide modulations it gives: the double blocks'
    image and text streams, the single blocks."""
    temb = model.time_guidance_embed(t)
    return temb, (
        model.double_stream_modulation_img(temb),
        model.double_stream_modulation_txt(temb),
        model.single_stream_modulation(temb),
    )


def _scan(blocks, body, carry, count: int, xs=None, start: int = 0):
    """Run `body(block, carry, layer_xs) -> (carry, ys)` over blocks start..count-1 of a stack; `xs`
    are per-layer stacks or None. The carry's token streams float[B, S, D] are pinned to their layout at
    every layer, so batch and tokens stay split (data / context parallelism) whatever propagation does."""
    graphdef, params = nnx.split(blocks)

    def step(carry, layers):
        layer_params, layer_xs = layers
        carry = jax.tree.map(lambda x: constrain(x, TOKENS) if x.ndim == 3 else x, carry)
        return body(nnx.merge(graphdef, layer_params), carry, layer_xs)

    return stacks.scan(step, carry, (params, xs), count, start)


def _block(blocks, index: int):
    """Block `index` of a stack, as a module of its own."""
    graphdef, params = nnx.split(blocks)
    return nnx.merge(graphdef, stacks.layer(params, index))


def _cached_key_rank(text: Padded, image: Padded, kv: ReferenceKV):
    """int32[1, T + R + N] over the keys [txt, cached ref, img], or None when none is padded."""
    if kv.key_rank is None and key_rank(text, image) is None:
        return None
    ref_rank = kv.key_rank if kv.key_rank is not None else jnp.zeros((1, kv.num_tokens), jnp.int32)
    return jnp.concatenate([stream_rank(text)[None], ref_rank, stream_rank(image)[None]], axis=1)


def _joined_rank(*parts):
    """The rank of concatenated streams from (rank or None, tokens) parts: None when every one is None."""
    if all(rank is None for rank, _ in parts):
        return None
    return jnp.concatenate([jnp.zeros(n, jnp.int32) if rank is None else rank for rank, n in parts])


def _per_token(batch: int, *parts):
    """Per-token modulation float[B, S, M] from (modulation float[B or 1, 1, M], count) parts, in order."""
    return jnp.concatenate([jnp.broadcast_to(m, (batch, n, m.shape[-1])) for m, n in parts], axis=1)
