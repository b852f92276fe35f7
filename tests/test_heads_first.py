"""A single block's q, k and v turned heads first by one Pallas kernel (`klein.models.heads_first`, a TPU
program's path), run on the CPU in Pallas' interpret mode against the XLA path every other platform runs:
the kernel alone, then a whole single block choosing it; and what it refuses. tests/tpu runs it compiled
(a TPU's transformer against the CPU's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klein.models import blocks, heads_first
from klein.models.layers import RMSNorm
from klein.models.rope import apply_rope, rope_tables
from klein.models.transformer_config import TransformerConfig
from tests.support.compare import max_abs
from tests.support.platforms import cpu_only

pytestmark = cpu_only("Pallas' interpret mode and the CPU's platform; tests/tpu runs the kernel compiled")

HEADS, HEAD_DIM, TOKENS = 3, 128, 96


def tables(tokens: int):
    ids = np.stack(
        [np.zeros(tokens), np.arange(tokens) % 7, np.arange(tokens) // 7, np.arange(tokens) % 3], 1
    )
    return tuple(jnp.asarray(t) for t in rope_tables(ids, (32, 32, 32, 32), 2000.0))


def norms(seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        norm = RMSNorm(HEAD_DIM, 1e-6, jnp.bfloat16)
        norm.scale[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(HEAD_DIM), jnp.bfloat16)
        out.append(norm)
    return out


def xla_path(proj, width, norm_q, norm_k, rope):
    """What every other platform computes: split, heads, RMSNorm, RoPE, then heads first."""
    q, k, v = (p.reshape(*p.shape[:2], -1, HEAD_DIM) for p in jnp.split(proj[..., : 3 * width], 3, axis=-1))
    q, k = apply_rope(norm_q(q), rope), apply_rope(norm_k(k), rope)
    return tuple(jnp.swapaxes(t, 1, 2) for t in (q, k, v))


@pytest.mark.parametrize(
    ("batch", "heads", "tokens"), [(1, HEADS, TOKENS), (2, HEADS, TOKENS), (1, 5, 200)]
)  # 200 tokens: blocks of 8, a bucket's odd count
def test_the_kernel_is_the_xla_path(batch, heads, tokens):
    width = heads * HEAD_DIM
    rng = np.random.default_rng(0)
    proj = jnp.asarray(rng.standard_normal((batch, tokens, 3 * width + 256)) * 3, jnp.bfloat16)
    rope, (norm_q, norm_k) = tables(tokens), norms()
    got = heads_first.heads_first(
        proj, width, HEAD_DIM, norm_q.scale[...], norm_k.scale[...], 1e-6, rope, interpret=True
    )
    want = xla_path(proj, width, norm_q, norm_k, rope)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.shape == w.shape == (batch, heads, tokens, HEAD_DIM) and g.dtype == jnp.bfloat16, name
        # One bf16 rounding step at most (the norm's sum may add up in another order).
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=8e-3, atol=1e-2)
        assert float(jnp.mean(g != w)) < 1e-3, name
    # Sensitive: k's and v's columns are not q's, and q is rotated.
    assert max_abs(got[0], want[1]) > 1 and max_abs(got[2], want[1]) > 1
    assert (
        max_abs(got[0], jnp.swapaxes(norm_q(proj[..., :width].reshape(batch, tokens, heads, HEAD_DIM)), 1, 2))
        > 0.1
    )


def test_what_it_takes():
    bf16 = jnp.zeros((1, 4608, 10), jnp.bfloat16)
    assert heads_first.supports(bf16, 128) and heads_first.block(4608) == 512
    assert heads_first.block(4096 + 77 * 8) == 8  # token buckets: multiples of 8 at least
    assert not heads_first.supports(bf16.astype(jnp.float32), 128)  # float32 programs: the XLA path
    assert not heads_first.supports(bf16, 96)  # heads that do not fill 128-lane columns
    assert not heads_first.supports(jnp.zeros((1, 101, 10), jnp.bfloat16), 128)


def test_a_single_block_with_the_kernel_is_the_block_without(monkeypatch):
    cfg = TransformerConfig(
        num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=HEAD_DIM,
        joint_attention_dim=64, in_channels=16,
    )  # fmt: skip
    block = blocks.SingleBlock(cfg, nnx.Rngs(0), jnp.bfloat16)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, TOKENS, cfg.hidden)), jnp.bfloat16)
    mod = jnp.asarray(rng.standard_normal((1, 1, 3 * cfg.hidden)) * 0.5, jnp.bfloat16)
    rope = tables(TOKENS)

    def attend(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / HEAD_DIM**0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1).astype(v.dtype), v)

    run = jax.jit(lambda x, mod: block(x, mod, rope, attend))
    want, (want_k, want_v) = run(x, mod)
    monkeypatch.setattr(blocks, "HEADS_FIRST_PLATFORMS", ("tpu", "cpu"))
    called = []
    real = heads_first.heads_first
    monkeypatch.setattr(heads_first, "heads_first", lambda *a, **kw: called.append(1) or real(*a, **kw))
    got, (got_k, got_v) = jax.jit(lambda x, mod: block(x, mod, rope, attend))(x, mod)
    assert called  # the kernel ran
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )
    assert max_abs(got_v, want_v) == 0 and max_abs(got_k, want_k) < 0.05
