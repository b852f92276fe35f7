"""The one attention function every model calls: the seam for kernels (XLA, cuDNN, splash).

Shapes: q float[B, Sq, H, Dh]; k, v float[B, Sk, K, Dh] with K dividing H (grouped queries); optional ranks
int32[B or 1, Sq] and int32[B or 1, Sk]: query i may attend to key j where k_rank[j] <= q_rank[i], so no
mask is an Sq x Sk tensor. Returns float[B, Sq, H, Dh]; a query that may attend to no key gets zeros (as
torch's SDPA gives the padded rows of a causal text encoder). The XLA kernel is tiled with an online
softmax (memory linear in tokens); on a mesh it runs per device inside `shard_map`. See
docs/design/compiling.md, "Sharding" and "TPU attention".
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.sharding import PartitionSpec

from klein import sharding
from klein.models import transcendentals
from klein.sharding import mesh_axis

QUERY_BLOCK = 256
KEY_BLOCK = 2048
MASKED = 2**30
"""Key rank of padding: above every query rank."""
_LOW = -1e30  # running max before any key: finite, so that exp(_LOW - _LOW) is 1 and not NaN


def attention(
    q, k, v, q_rank=None, k_rank=None, *, causal: bool = False, keys_only: bool = False
) -> jnp.ndarray:
    """`keys_only`: every query ranks 0 and some keys `MASKED` (padding), so every query sees every real key:
    the blocked kernel then adds a bias to the masked keys' scores rather than comparing ranks."""
    mesh, platform = jax.sharding.get_abstract_mesh(), sharding.platform()
    local = functools.partial(_local, causal=causal, platform=platform, keys_only=keys_only)
    if _one_device(mesh):  # nothing to split: the kernel as it is (cuDNN's too, which takes no ranks)
        return local(q, k, v, q_rank, k_rank)
    if q_rank is None:
        q_rank, k_rank = jnp.zeros((1, q.shape[1]), jnp.int32), jnp.zeros((1, k.shape[1]), jnp.int32)
    # Splash's static causal mask knows no offset: its queries stay whole along their tokens.
    split_tokens = not (causal and _splash(q, platform))
    return _sharded(mesh, local, q, k, v, q_rank, k_rank, split_tokens)


class Keys(NamedTuple):
    """What a transformer layer's queries see, as data for `attend`.

    rank: int32[1, keys], 0 for a key and `MASKED` for padding; None when nothing is padded (the
    unmasked kernel). isolated: joint tokens [start, stop) that see only each other (the references of
    KV editing in one pass), or None. cached: one layer's reference (k, v) float[R, H, Dh], spliced into
    the keys and values after the first `cached_at` joint tokens (the text), or None."""

    rank: jnp.ndarray | None = None
    isolated: tuple[int, int] | None = None
    cached: tuple[jnp.ndarray, jnp.ndarray] | None = None
    cached_at: int = 0


def attend(q, k, v, keys: Keys):
    """Attention of queries q float[B, Sq, H, Dh] over the joint keys and values k, v float[B, S, H, Dh]
    (and the cached ones) as `keys` says."""
    if keys.cached is not None:
        k, v = (_splice(x, cached, keys.cached_at) for x, cached in zip((k, v), keys.cached, strict=True))
    if keys.isolated is not None:
        return isolated_span_attention(q, k, v, *keys.isolated, keys.rank)
    return _padded_keys(q, k, v, keys.rank)


def _splice(x, cached, at: int):
    """x float[B, S, H, Dh] with cached float[R, H, Dh] (the same for every image) after its first `at`
    tokens."""
    cached = jnp.broadcast_to(cached, (x.shape[0], *cached.shape))
    return jnp.concatenate([x[:, :at], cached, x[:, at:]], axis=1)


class Padded(NamedTuple):
    """A token stream as the layers see it: tokens [B, S', ...], rope [S', Dh] and rank int32[S'] (0 for
    its tokens, `MASKED` for padding), or None when none of it is padding (the unmasked kernel)."""

    tokens: jnp.ndarray
    rope: tuple
    rank: jnp.ndarray | None


def padded(tokens, rope, rank=None) -> Padded:
    """Tokens [B, S, ...] and their rope tables [S, Dh], `rank` int32[S] (None: all real; else data, 0 or
    `MASKED`: a stream padded to its token bucket, `klein.request.buckets`), with zero tokens appended up
    to a multiple of the context size (`sharding.context_ways`), so that the stream splits over the devices
    whatever its length. Padding's keys rank `MASKED` (no query sees them); the caller drops its outputs."""
    real = tokens.shape[1]
    extra = -real % sharding.context_ways()
    if rank is None and not extra:
        return Padded(tokens, rope, None)
    rank = jnp.zeros(real, jnp.int32) if rank is None else jnp.asarray(rank, jnp.int32)
    rank = jnp.concatenate([rank, jnp.full(extra, MASKED, jnp.int32)])
    return Padded(_pad_tokens(tokens, extra), tuple(_pad_tokens(t, extra, 0) for t in rope), rank)


def _pad_tokens(x, extra: int, axis: int = 1):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths) if extra else x


def stream_rank(stream: Padded):
    """int32[S'] of one stream: its rank, zeros where none of it is padding."""
    return jnp.zeros(stream.tokens.shape[1], jnp.int32) if stream.rank is None else stream.rank


def key_rank(*streams: Padded):
    """int32[1, S] over the concatenated streams, or None when none is padded (the unmasked kernel)."""
    if all(s.rank is None for s in streams):
        return None
    return jnp.concatenate([stream_rank(s) for s in streams])[None]


def isolated_span_attention(q, k, v, start: int, stop: int, k_rank=None) -> jnp.ndarray:
    """Attention over one joint sequence in which tokens [start, stop) see only each other and every
    other token sees all (KV editing's reference tokens). `k_rank`: None, or 0 for keys and `MASKED`
    for padding. On cuDNN (one device) and on a TPU: two calls (the span over its own keys, the rest over
    all keys); elsewhere the span's ranks."""
    platform, one_device = sharding.platform(), _one_device(jax.sharding.get_abstract_mesh())
    if _splash(q, platform) or (_cudnn(q, platform) and one_device):
        # Two attentions whose queries each rank the same (key padding at most).
        span_rank = None if k_rank is None else k_rank[:, start:stop]
        inside = _padded_keys(q[:, start:stop], k[:, start:stop], v[:, start:stop], span_rank)
        outside = _padded_keys(q, k, v, k_rank)
        return jnp.concatenate([outside[:, :start], inside, outside[:, stop:]], axis=1)
    span = (jnp.arange(q.shape[1]) < start) | (jnp.arange(q.shape[1]) >= stop)
    rank = span.astype(jnp.int32)[None]  # 0 inside the span, 1 outside
    k_span = rank[:, : k.shape[1]]
    return attention(q, k, v, rank, k_span if k_rank is None else jnp.maximum(k_span, k_rank))


CUDNN_MAX_HEAD_DIM = 256
"""cuDNN's fused attention takes head dims up to this, in multiples of 8 (the VAE's one 512-wide head
runs the blocked attention instead)."""


def _cudnn(q, platform: str) -> bool:
    head_dim = q.shape[-1]
    fits = head_dim <= CUDNN_MAX_HEAD_DIM and head_dim % 8 == 0
    return fits and q.dtype == jnp.bfloat16 and platform == "gpu"


def _one_device(mesh) -> bool:
    """No mesh, or a mesh of one device (a GPU compiled for from another machine is one)."""
    return mesh.empty or mesh.size == 1


def _padded_keys(q, k, v, k_rank):
    """Attention whose queries all rank 0 over keys ranked 0 or `MASKED` (None: none padded)."""
    if k_rank is None:
        return attention(q, k, v)
    if _cudnn(q, sharding.platform()) and _one_device(jax.sharding.get_abstract_mesh()):
        return _cudnn_padded_keys(q, k, v, k_rank)
    return attention(q, k, v, jnp.zeros((1, q.shape[1]), jnp.int32), k_rank, keys_only=True)


def _cudnn_padded_keys(q, k, v, k_rank):
    """cuDNN's fused attention over keys some of which are padding, anywhere among them: the keys and
    values gathered so that the real ones come first (a stable order: attention does not depend on the
    keys' order), the padding cut off by the kernel's key lengths."""
    order = jnp.argsort(k_rank[0], stable=True)
    real = jnp.sum(k_rank[0] == 0, dtype=jnp.int32)
    k, v = (jnp.take(x, order, axis=1) for x in (k, v))
    lengths = jnp.full((q.shape[0],), real, jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")


SPLASH_PLATFORMS = ("tpu",)
"""Platforms whose programs attend with splash (tests add "cpu", where Pallas interprets it)."""


def _splash(q, platform: str) -> bool:
    if platform not in SPLASH_PLATFORMS:
        return False
    # Imported only for programs that use it: Pallas adds a fifth of a second to an import of the models.
    from klein.models import splash

    return splash.supports(q)


def _local(q, k, v, q_rank, k_rank, causal: bool = False, platform: str = "cpu", keys_only: bool = False):
    if _splash(q, platform):
        from klein.models import splash

        return splash.attention(q, k, v, q_rank, k_rank, causal, interpret=platform != "tpu")
    if q_rank is None and _cudnn(q, platform):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    return _blocked(q, k, v, None if keys_only else q_rank, k_rank)


def _sharded(mesh, local, q, k, v, q_rank, k_rank, split_tokens: bool):
    """`local` per device: queries split along batch, tokens (if `split_tokens`) and heads; keys whole
    along tokens."""
    b, sq, h, _ = q.shape

    def axis(logical, *sizes):
        name = mesh_axis(logical, mesh)
        return name if name is not None and all(n % mesh.shape[name] == 0 for n in sizes) else None

    batch, heads = axis("batch", b), axis("heads", h, k.shape[2])
    tokens = axis("seq", sq) if split_tokens else None

    def rank_batch(rank):
        return batch if rank.shape[0] == b else None

    specs = (
        PartitionSpec(batch, tokens, heads),
        PartitionSpec(batch, None, heads),
        PartitionSpec(batch, None, heads),
        PartitionSpec(rank_batch(q_rank), tokens),
        PartitionSpec(rank_batch(k_rank), None),
    )
    run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)
    return run(q, k, v, q_rank, k_rank)


def _blocked(q, k, v, q_rank, k_rank):
    """Tiles of QUERY_BLOCK x KEY_BLOCK on one device, heads-major, an online softmax in float32 over the
    key blocks. Keys are cut into even blocks once, before the loop (no key padded, so no mask without
    ranks; `benchmarks/speed/attention_speed.py`). With `k_rank` alone (every query sees every real key) the
    masked keys' scores get a bias of `_LOW` instead: no compare per score, and a block of padding alone
    weighs nothing once a real key is met (the running max's correction zeroes it)."""
    _, sq, h, dh = q.shape
    sk, groups = k.shape[1], h // k.shape[2]
    q_size = min(QUERY_BLOCK, sq)
    q_count = -(-sq // q_size)
    k_size = -(-sk // -(-sk // KEY_BLOCK))  # even key blocks; the last one has what is left
    masked = q_rank is not None
    if masked:
        q_rank = rearrange(_pad(q_rank, q_count * q_size, 0), "b (n q) -> n b q", n=q_count)
        q_rank = jnp.tile(q_rank, (1, 1, groups))  # [Q, B|1, G*q]
    else:  # a placeholder that the loop carries and never reads
        q_rank = jnp.zeros((q_count,))
    # Padded query rows attend like any other and are dropped at the end.
    q = _pad(q * jnp.asarray(dh**-0.5, q.dtype), q_count * q_size, 0)
    q = rearrange(q, "b (n q) (k g) d -> n b k (g q) d", n=q_count, g=groups)  # a key head's queries
    k, v = (rearrange(x, "b s k d -> b k s d") for x in (k, v))
    # Key blocks are cut once, before the loop over query blocks; no key is padded.
    bias = None if masked or k_rank is None else jnp.where(k_rank > 0, _LOW, 0.0).astype(jnp.float32)
    blocks = [
        (
            k[:, :, s : s + k_size],
            v[:, :, s : s + k_size],
            k_rank[:, s : s + k_size] if masked else None,
            None if bias is None else bias[:, None, None, s : s + k_size],
        )
        for s in range(0, sk, k_size)
    ]

    def one(args):
        q_block, q_block_rank = args
        rows = q_block.shape[:-1]
        carry = (  # running max, sum, weighted values
            jnp.full(rows, _LOW, jnp.float32),
            jnp.zeros(rows, jnp.float32),
            jnp.zeros(q_block.shape, jnp.float32),
        )
        for block in blocks:
            carry = _tile(carry, q_block, *block, q_block_rank, masked)
        _, total, acc = carry
        return (acc / jnp.where(total == 0, 1.0, total)[..., None]).astype(q.dtype)

    out = jax.lax.map(one, (q, q_rank))
    return rearrange(out, "n b k (g q) d -> b (n q) (k g) d", g=groups)[:, :sq]


def _tile(carry, q_block, k_block, v_block, k_rank, bias, q_rank, masked: bool):
    """Fold one key block into the running (max, sum, weighted values) of a query block."""
    running_max, total, acc = carry
    scores = jnp.einsum("bkqd,bkjd->bkqj", q_block, k_block, preferred_element_type=jnp.float32)
    if bias is not None:
        scores = scores + bias
    if masked:
        allowed = k_rank[:, None, None, :] <= q_rank[:, None, :, None]
        scores = jnp.where(allowed, scores, _LOW)
    new_max = jnp.maximum(running_max, scores.max(-1))
    weights = transcendentals.exp(scores - new_max[..., None])
    if masked:
        weights = jnp.where(allowed, weights, 0.0)
    correction = transcendentals.exp(running_max - new_max)
    total = total * correction + weights.sum(-1)
    values = jnp.einsum(
        "bkqj,bkjd->bkqd", weights.astype(v_block.dtype), v_block, preferred_element_type=jnp.float32
    )
    return new_max, total, acc * correction[..., None] + values


def _pad(x, size: int, value):
    """Pad the token axis (1) of x to `size`."""
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, size - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)
