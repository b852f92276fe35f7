"""On a TPU chip: the splash kernel klein's programs attend with there (`klein.models.splash`, compiled by
Mosaic, not interpreted) against XLA's blocked kernel on the same chip, at the models' head geometry
(24 heads of 128, klein-4b's) and token counts no multiple of its 512-token blocks, for every mask the
models use: none, key padding, causal with padding (the text encoder), KV editing's isolated reference
span, and cached reference keys spliced after the text. float32 runs under `highest` precision on both
sides, so it compares as float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klein.models import attention as A
from klein.models.attention import MASKED, Keys
from tests.support.compare import max_abs

pytestmark = pytest.mark.tpu

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}
"""Largest |splash - XLA| over outputs of scale ~1: float32 summation order; bf16 rounding of each."""
HEADS, HEAD_DIM = 24, 128
DTYPES = [jnp.float32, jnp.bfloat16]


def qkv(n_q, n_k, dtype, batch=1, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((batch, n_q, HEADS, HEAD_DIM), (batch, n_k, HEADS, HEAD_DIM), (batch, n_k, HEADS, HEAD_DIM))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def on_chip(fn, *args):
    """`fn(*args)` jitted; float32 under `highest` precision, as klein's float32 programs run (Mosaic compiles
    splash's bf16 products at the default alone)."""
    if args[0].dtype != jnp.float32:
        return jax.jit(fn)(*args)
    with jax.default_matmul_precision("highest"):
        return jax.jit(fn)(*args)


def xla(q, k, v, q_rank=None, k_rank=None):
    return on_chip(A._blocked, q, k, v, q_rank, k_rank)


def close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    err = max_abs(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert err < TOLERANCE[dtype], err


def test_the_seam_attends_with_splash_on_the_chip(monkeypatch):
    from klein.models import splash

    calls = []
    kernel = splash.attention
    monkeypatch.setattr(splash, "attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    q, k, v = qkv(600, 600, jnp.bfloat16)
    on_chip(A.attention, q, k, v)
    assert calls == [{"interpret": False}]  # compiled by Mosaic, not interpreted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1000, 4608])  # 4608: a 1024^2 image and 512 text tokens
def test_unmasked(dtype, tokens):
    q, k, v = qkv(tokens, tokens, dtype)
    close(on_chip(A.attention, q, k, v), xla(q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_padding(dtype):
    """The transformer's bucketed streams: [txt, ref, img] with padding inside and at the end."""
    n = 1300
    q, k, v = qkv(n, n, dtype, batch=2)
    rank = np.zeros((2, n), np.int32)
    rank[0, 1200:] = MASKED
    rank[1, 300:420] = MASKED
    q_rank, k_rank = jnp.zeros((1, n), jnp.int32), jnp.asarray(rank)
    want = xla(q, k, v, q_rank, k_rank)
    close(on_chip(lambda *a: A.attention(*a, keys_only=True), q, k, v, q_rank, k_rank), want, dtype)
    assert max_abs(np.asarray(xla(q, k, v), np.float32), np.asarray(want, np.float32)) > 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_and_padding(dtype):
    """The text encoder: positions as ranks, left padding whose queries see nothing (zeros)."""
    n = 700
    q, k, v = qkv(n, n, dtype, batch=2)
    positions = np.broadcast_to(np.arange(n), (2, n))
    valid = np.ones((2, n), bool)
    valid[0, :100] = False
    valid[1, 650:] = False
    q_rank = jnp.asarray(positions, jnp.int32)
    k_rank = jnp.asarray(np.where(valid, positions, MASKED), jnp.int32)
    got = on_chip(lambda *a: A.attention(*a, causal=True), q, k, v, q_rank, k_rank)
    close(got, xla(q, k, v, q_rank, k_rank), dtype)
    assert float(jnp.abs(got[0, :100].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padded", [False, True])
def test_isolated_reference_span(dtype, padded):
    """KV editing's uncached pass: references [start, stop) see only themselves."""
    n, start, stop = 1400, 512, 1100
    q, k, v = qkv(n, n, dtype)
    k_rank = jnp.asarray(np.where(np.arange(n) % 300 == 299, MASKED, 0)[None], jnp.int32) if padded else None
    got = on_chip(lambda *a: A.isolated_span_attention(*a, start, stop, k_rank), q, k, v)
    span = ((np.arange(n) < start) | (np.arange(n) >= stop)).astype(np.int32)[None]
    k_span = span if k_rank is None else np.maximum(span, k_rank)
    close(got, xla(q, k, v, jnp.asarray(span), jnp.asarray(k_span)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padded", [False, True])
def test_cached_reference_keys(dtype, padded):
    """KV editing's cached steps: one layer's reference keys and values spliced after the text."""
    text, image, refs = 512, 1000, 700
    q, k, v = qkv(text + image, text + image, dtype, batch=2)
    cached = [x[0] for x in qkv(refs, refs, dtype, seed=1)[1:]]
    total = text + refs + image
    rank = (
        jnp.asarray(np.where(np.arange(total) >= total - 40, MASKED, 0)[None], jnp.int32) if padded else None
    )
    got = on_chip(lambda *a: A.attend(*a, Keys(rank=rank, cached=cached, cached_at=text)), q, k, v)
    k_all, v_all = (A._splice(x, c, text) for x, c in zip((k, v), cached, strict=True))
    q_rank = None if rank is None else jnp.zeros((1, text + image), jnp.int32)
    close(got, xla(q, k_all, v_all, q_rank, rank), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_keys_in_wide_tiles(dtype):
    """A cached step with one 1024^2 reference: 4,608 queries over 8,704 keys, whose tiles take
    `splash.WIDE_KEYS` keys (padded to 10,240), the last 100 keys masked as bucket padding."""
    from klein.models import splash

    text_image, refs = 4608, 4096
    assert splash._key_block(text_image + refs) == splash.WIDE_KEYS
    q = qkv(text_image, text_image, dtype)[0]
    k, v = qkv(text_image + refs, text_image + refs, dtype, seed=2)[1:]
    rank = jnp.asarray(
        np.where(np.arange(text_image + refs) >= text_image + refs - 100, MASKED, 0)[None], jnp.int32
    )
    q_rank = jnp.zeros((1, text_image), jnp.int32)
    got = on_chip(lambda *a: A.attention(*a, keys_only=True), q, k, v, q_rank, rank)
    close(got, xla(q, k, v, q_rank, rank), dtype)
