"""The TPU attention path (Pallas splash attention, `klein.models.splash`) against klein's XLA attention,
run on the CPU in Pallas' interpret mode: every mask klein uses (none, key padding, causal + padding, KV
editing's isolated span with and without padding), f32 and bf16, grouped queries, head dims 128 and 256,
token counts that are no multiple of the blocks; and the seam choosing it for a TPU program, on a mesh too.

Blocks of 128 tokens (the kernel's smallest) keep several tiles per call on small inputs; interpreting
is slow, so the shapes stay small."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klein import sharding
from klein.models import attention as A
from klein.models import splash
from klein.models.attention import MASKED, attention, isolated_span_attention
from klein.sharding import use
from tests.support.compare import max_abs
from tests.support.platforms import cpu_only

pytestmark = cpu_only(
    "Pallas' interpret mode and the CPU's platform (on a v5e 8 of these failed: float32 bounds at the "
    "default precision, the seam picking the compiled kernel); tests/tpu/test_tpu_attention.py runs it compiled"
)

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(splash, "BLOCK", splash.LANES)


@pytest.fixture
def splash_on_cpu(monkeypatch):
    """The seam attends with splash in CPU programs too, interpreted."""
    monkeypatch.setattr(A, "SPLASH_PLATFORMS", ("tpu", "cpu"))


def qkv(n_q, n_k, heads=4, kv_heads=2, head_dim=128, dtype=jnp.float32, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    shapes = (
        (batch, n_q, heads, head_dim),
        (batch, n_k, kv_heads, head_dim),
        (batch, n_k, kv_heads, head_dim),
    )
    return [jnp.asarray(rng.standard_normal(s) * 2, dtype) for s in shapes]


def close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def splashed(*args, causal=False):
    return jax.jit(lambda *a: splash.attention(*a, causal=causal, interpret=True))(*args)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n_q,n_k,heads,kv_heads,head_dim", [(200, 300, 4, 2, 128), (77, 77, 2, 2, 256)])
def test_unmasked(dtype, n_q, n_k, heads, kv_heads, head_dim):
    q, k, v = qkv(n_q, n_k, heads, kv_heads, head_dim, dtype)
    close(splashed(q, k, v), A._blocked(q, k, v, None, None), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_key_padding(dtype):
    """The transformer's context padding: every query ranks 0, padded keys `MASKED`, per image."""
    q, k, v = qkv(150, 260, dtype=dtype)
    valid = np.ones((2, 260), bool)
    valid[0, 250:] = False
    valid[1, 100:130] = False  # a padded stream in the middle, as [txt, ref, img] joins three
    q_rank = jnp.zeros((1, 150), jnp.int32)
    k_rank = jnp.asarray(np.where(valid, 0, MASKED), jnp.int32)
    want = A._blocked(q, k, v, q_rank, k_rank)
    close(splashed(q, k, v, q_rank, k_rank), want, dtype)
    assert max_abs(splashed(q, k, v), want) > 1e-2  # sensitive: the padded keys matter


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_causal_and_padding(dtype):
    """The text encoder's ranks: positions, padded keys `MASKED`; rows that see no key give zeros."""
    length = 150
    q, k, v = qkv(length, length, dtype=dtype)
    valid = np.ones((2, length), bool)
    valid[0, :40] = False  # left padding: those queries see nothing
    valid[1, 130:] = False
    positions = np.arange(length)
    q_rank = jnp.asarray(np.broadcast_to(positions, (2, length)), jnp.int32)
    k_rank = jnp.asarray(np.where(valid, positions, MASKED), jnp.int32)
    got = splashed(q, k, v, q_rank, k_rank, causal=True)
    close(got, A._blocked(q, k, v, q_rank, k_rank), dtype)
    assert float(jnp.abs(got[0, :40].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_isolated_span_through_the_seam(splash_on_cpu, dtype, padded):
    """KV editing's uncached pass: [txt, ref, img] with the references seeing only themselves."""
    n, start, stop = 230, 40, 170
    q, k, v = qkv(n, n, dtype=dtype)
    k_rank = None
    if padded:
        k_rank = jnp.asarray(np.where(np.arange(n) % 50 == 49, MASKED, 0)[None], jnp.int32)
    got = jax.jit(lambda *a: isolated_span_attention(*a, start, stop, k_rank))(q, k, v)
    span = ((np.arange(n) < start) | (np.arange(n) >= stop)).astype(np.int32)[None]
    k_span = span if k_rank is None else np.maximum(span, k_rank)
    close(got, A._blocked(q, k, v, jnp.asarray(span), jnp.asarray(k_span)), dtype)


def test_the_seam_picks_splash_for_tpu_programs(splash_on_cpu, monkeypatch):
    calls = []
    kernel = splash.attention
    monkeypatch.setattr(splash, "attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    q, k, v = qkv(130, 130)
    close(jax.jit(attention)(q, k, v), A._blocked(q, k, v, None, None), jnp.float32)
    assert calls == [{"interpret": True}]
    # Head dims splash cannot take stay on XLA's kernel.
    small = qkv(20, 20, head_dim=16)
    close(jax.jit(attention)(*small), A._blocked(*small, None, None), jnp.float32)
    assert len(calls) == 1


def test_on_a_mesh(splash_on_cpu):
    """Inside shard_map (a one-device mesh here): key padding split along tokens, causal kept whole."""
    mesh = jax.make_mesh((1,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = qkv(140, 140)
    k_rank = jnp.asarray(np.where(np.arange(140) >= 133, MASKED, 0)[None], jnp.int32)
    q_rank = jnp.zeros((1, 140), jnp.int32)
    positions = jnp.arange(140, dtype=jnp.int32)[None]
    with use(mesh):
        padded = jax.jit(attention)(q, k, v, q_rank, k_rank)
        causal = jax.jit(lambda *a: attention(*a, causal=True))(q, k, v, positions, positions)
    close(padded, A._blocked(q, k, v, q_rank, k_rank), jnp.float32)
    close(causal, A._blocked(q, k, v, positions, positions), jnp.float32)


def test_platform_is_the_meshes():
    """A mesh of TPU devices makes a TPU program even on a CPU host (`klein plan --target`)."""
    seen = []
    trace = jax.jit(lambda x: seen.append(sharding.platform()) or x)
    trace(1.0)
    with use(jax.make_mesh((1,), ("data",))):
        trace(2.0)
    assert seen == [jax.default_backend(), "cpu"]  # the TPU slice's case: tests/test_tpu_compile.py
