"""8-bit reference keys and values (`klein.models.reference_kv8`): the rounding's bound, a prefill in
pieces equal to the whole one, and KV editing over int8 keys and values within a stated tolerance of the
same over float ones, and out of it once the scales are off."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klein.models import reference_kv8
from klein.models import transformer as T
from klein.models.blocks import in_pieces
from klein.models.rope import rope_tables
from klein.models.transformer_config import TransformerConfig
from klein.sampling import image_ids, reference_ids, text_ids
from tests.support.compare import rel_err

CFG = TransformerConfig(
    num_layers=1,
    num_single_layers=2,
    num_attention_heads=4,
    attention_head_dim=16,
    joint_attention_dim=32,
    in_channels=16,
    axes_dims_rope=(4, 4, 4, 4),
)
PREFILL = nnx.jit(T.prefill, static_argnames="kv_dtype")
VELOCITY_TOL = 0.005
"""Largest relative error (max abs over the output's scale) of the velocity over int8 keys and values."""


@pytest.fixture(scope="module")
def model():
    return T.Flux2Transformer(CFG, rngs=nnx.Rngs(3))


def test_quantise_rounds_within_half_a_step_per_head():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 3, 8)).astype(np.float32) * np.array([0.1, 1.0, 30.0])[None, :, None]
    values, scale = reference_kv8.quantise(jnp.asarray(x))
    assert values.dtype == jnp.int8 and scale.shape == (3,)
    np.testing.assert_allclose(scale, np.abs(x).max(axis=(0, 2)) / 127, rtol=1e-6)
    back = np.asarray(reference_kv8.dequantise(values, scale, jnp.float32))
    assert np.all(np.abs(back - x) <= np.asarray(scale)[None, :, None] / 2 * 1.0001)
    # Padding (not real) neither sets the scale nor escapes the clip.
    x[0] = 1e4
    real = jnp.arange(40) > 0
    values, padded_scale = reference_kv8.quantise(jnp.asarray(x), real)
    np.testing.assert_allclose(padded_scale, scale, rtol=1e-6)
    assert int(jnp.abs(values.astype(jnp.int32)).max()) == 127


def test_in_pieces_joins_pieces_in_order():
    x = jnp.arange(2 * 10 * 3, dtype=jnp.float32).reshape(2, 10, 3)
    rope = jnp.arange(10, dtype=jnp.float32)[:, None]
    got = in_pieces(lambda x, r: x * 2 + r[None], 4, (x, 1), (rope, 0))  # 3 pieces of 4, 2 rows padded
    np.testing.assert_array_equal(got, x * 2 + rope[None])


def _inputs(model, refs=((4, 6), (5, 4))):
    rng = np.random.default_rng(1)
    n_ref = sum(h * w for h, w in refs)
    ref = jnp.asarray(rng.standard_normal((n_ref, CFG.in_channels)), jnp.float32)
    img = jnp.asarray(rng.standard_normal((2, 12, CFG.in_channels)), jnp.float32)
    txt = jnp.asarray(rng.standard_normal((2, 5, CFG.joint_attention_dim)), jnp.float32)
    ropes = [
        rope_tables(i, CFG.axes_dims_rope, CFG.rope_theta)
        for i in (reference_ids(list(refs)), image_ids(3, 4), text_ids(5))
    ]
    return ref, img, txt, jnp.asarray([0.7, 0.3], jnp.float32), ropes


def _velocity(model, kv, inputs):
    _, img, txt, t, (_, img_rope, txt_rope) = inputs
    return np.asarray(nnx.jit(T.forward_cached)(model, img, txt, t, img_rope, txt_rope, kv))


def test_int8_kv_is_close_to_float_kv_and_its_scales_matter(model, monkeypatch):
    monkeypatch.setattr(reference_kv8, "PREFILL_PIECE", 16)  # 44 reference tokens: 3 pieces
    inputs = _inputs(model)
    ref, _, _, _, (ref_rope, _, _) = inputs
    exact = PREFILL(model, ref, ref_rope)
    kv8 = PREFILL(model, ref, ref_rope, kv_dtype=reference_kv8.INT8)
    assert kv8.kv_dtype == reference_kv8.INT8 and kv8.double_k.dtype == jnp.int8
    assert kv8.scales[2].shape == (CFG.num_single_layers, CFG.num_attention_heads)
    # The pieces compute the same keys and values as the whole prefill (then rounded to int8).
    for stack, scales, float_stack in zip(kv8.arrays, kv8.scales, exact.arrays, strict=True):
        widened = reference_kv8.dequantise(stack, scales, jnp.float32)
        assert np.all(np.abs(widened - float_stack) <= scales[:, None, :, None] / 2 + 1e-5)
    want = _velocity(model, exact, inputs)
    error = rel_err(_velocity(model, kv8, inputs), want)
    print(f"int8 keys and values: velocity {error:.2e} off")
    assert 0 < error < VELOCITY_TOL
    # Scales 10% off (each head of every layer): the velocity leaves the tolerance.
    off = kv8._replace(scales=tuple(s * 1.1 for s in kv8.scales))
    assert rel_err(_velocity(model, off, inputs), want) > 2 * error


def test_uncached_reference_padding_does_not_set_the_scales(model):
    inputs = _inputs(model, refs=((4, 4),))
    ref, _, _, _, (ref_rope, _, _) = inputs
    rank = jnp.asarray([0] * 12 + [2**30] * 4, jnp.int32)  # the last 4 tokens padding
    kv8 = PREFILL(model, ref, ref_rope, rank, kv_dtype=reference_kv8.INT8)
    real = PREFILL(model, ref[:12], tuple(t[:12] for t in ref_rope), kv_dtype=reference_kv8.INT8)
    for padded, alone in zip(kv8.scales, real.scales, strict=True):
        np.testing.assert_allclose(padded, alone, rtol=1e-5)
