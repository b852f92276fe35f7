"""Our transformer against diffusers' Flux2Transformer2DModel on the tiny strengthened fixture.

Every mode: text-to-image, standard editing with references, and the KV-cache modes (prefill keys and
values, cached forward at step 0 and later, and our cached vs our uncached path).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from klein.io.transformer_checkpoint import load_transformer
from klein.models import stacks
from klein.models.attention import MASKED, attention
from tests.support.compare import assert_close, rel_err
from tests.support.tiny_transformer import with_kv_processors
from tests.support.transformer_inputs import (
    diffusers_extract,
    diffusers_references,
    forward_cached,
    forward_kv_uncached,
    jx,
    make_case,
    ours_kv,
    ours_plain,
    prefill,
    ropes,
    torch_call,
)

TOL = 1e-4  # max abs error relative to the output's scale (fp32 on both sides)


def last_single_block(model):
    """The last single block of `model`'s stack, as a module of its own."""
    graphdef, params = nnx.split(model.single_transformer_blocks)
    return nnx.merge(graphdef, stacks.layer(params, model.cfg.num_single_layers - 1))


@pytest.fixture(scope="module")
def models(tiny_transformer):
    folder, reference = tiny_transformer
    return load_transformer(folder / "transformer"), with_kv_processors(reference)


@pytest.mark.parametrize("batch", [1, 2])
def test_text_to_image(models, batch):
    ours, ref = models
    case = make_case(0, batch)
    assert_close(ours_plain(ours, case), torch_call(ref, case)[0].numpy(), TOL)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("ref_sizes", [[(4, 4)], [(2, 3), (4, 2), (3, 5)]])
def test_standard_references(models, batch, ref_sizes):
    ours, ref = models
    case = make_case(1, batch, ref_sizes=ref_sizes)
    (ref_rope,) = ropes(ours, case.ref_ids)
    got = ours_plain(ours, case, refs=(case.ref[None], ref_rope))
    assert_close(got, diffusers_references(ref, case), TOL)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("ref_sizes", [[(4, 4)], [(2, 3), (4, 2), (3, 5)]])
def test_kv_step0_and_prefill_equal_diffusers_extract(models, batch, ref_sizes):
    ours, ref = models
    case = make_case(2, batch, ref_sizes=ref_sizes)
    want, cache = diffusers_extract(ref, case)
    got, kv = ours_kv(ours, case)
    assert_close(got, want, TOL)
    stacks = [(kv.double_k, kv.double_v, cache.get_double), (kv.single_k, kv.single_v, cache.get_single)]
    for k_stack, v_stack, layer_cache in stacks:
        for i in range(k_stack.shape[0]):
            k_ref, v_ref = (x.numpy() for x in layer_cache(i).get())
            for b in range(batch):  # diffusers stores one copy per image; ours has no batch axis
                assert_close(k_stack[i], k_ref[b], TOL)
                assert_close(v_stack[i], v_ref[b], TOL)


def test_kv_later_steps_equal_diffusers_cached(models):
    ours, ref = models
    case0 = make_case(3, 2, ref_sizes=[(3, 4), (2, 2)])
    _, cache = diffusers_extract(ref, case0)
    img_rope, txt_rope, ref_rope = ropes(ours, case0.img_ids, case0.txt_ids, case0.ref_ids)
    kv = prefill(ours, jx(case0.ref)[0], ref_rope)
    for seed, t in [(4, [0.6, 0.6]), (5, [0.25, 0.9])]:
        case = make_case(seed, 2, t=t)
        want = torch_call(ref, case, kv_cache=cache, kv_cache_mode="cached")[0].numpy()
        got = forward_cached(ours, *jx(case.img, case.txt, case.t), img_rope, txt_rope, kv)
        assert_close(got, want, TOL)


def test_cached_equals_uncached(models):
    ours, _ = models
    case = make_case(6, 2, ref_sizes=[(2, 3), (4, 2), (3, 5)])
    img_rope, txt_rope, ref_rope = ropes(ours, case.img_ids, case.txt_ids, case.ref_ids)
    got, _ = ours_kv(ours, case)
    args = (*jx(case.img, case.txt, case.t), img_rope, txt_rope)
    uncached = forward_kv_uncached(ours, *args, jx(case.ref)[0], ref_rope)
    assert_close(got, uncached, 1e-5)


def test_inputs_move_the_output(models):
    """Sensitivity: prompt, references and timestep each change the output far beyond TOL, so the
    parity tests above cannot pass with a model that ignores them."""
    _, ref = models
    case = make_case(7, 1, ref_sizes=[(4, 4)])
    base, _ = diffusers_extract(ref, case)
    other_prompt = make_case(7, 1, ref_sizes=[(4, 4)])
    other_prompt.txt = np.random.default_rng(99).standard_normal(case.txt.shape).astype(np.float32)
    other_ref = make_case(7, 1, ref_sizes=[(4, 4)])
    other_ref.ref = other_ref.ref + 0.5
    other_t = make_case(7, 1, ref_sizes=[(4, 4)], t=[0.2])
    for changed in (other_prompt, other_ref, other_t):
        assert rel_err(diffusers_extract(ref, changed)[0], base) > 0.01


def test_parity_detects_a_perturbed_weight(models, tiny_transformer):
    """A 1% change in one block's weight makes the parity check fail."""
    folder, ref = tiny_transformer
    perturbed = load_transformer(folder / "transformer")
    kernel = perturbed.single_transformer_blocks.attn.to_out.kernel
    kernel[...] = kernel[...].at[1].multiply(1.01)
    case = make_case(8, 1)
    want = torch_call(ref, case)[0].numpy()
    assert_close(ours_plain(models[0], case), want, TOL)
    assert rel_err(ours_plain(perturbed, case), want) > 10 * TOL


@pytest.mark.parametrize("per_token", [False, True])
def test_last_block_rows_equal_the_whole_block(models, per_token):
    """The last single block over the kept rows only == the block over every token, rows kept after;
    with one-per-image or per-token modulation and a masked (padded) key. Keys come from every token:
    changing a token outside the rows moves the result."""
    block = last_single_block(models[0])
    rng = np.random.default_rng(10)
    d, tokens = block.width, 11
    x = jnp.asarray(rng.standard_normal((2, tokens, d)), jnp.float32)
    mod = jnp.asarray(rng.standard_normal((2, tokens if per_token else 1, 3 * d)) * 0.3, jnp.float32)
    angles = rng.uniform(0, 6, (tokens, block.head_dim))
    rope = (jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))
    k_rank = jnp.asarray([[0] * (tokens - 1) + [MASKED]], jnp.int32)

    def attend(q, k, v):
        return attention(q, k, v, jnp.zeros((1, q.shape[1]), jnp.int32), k_rank)

    got = block.rows(x, mod, rope, attend, 3, 8)
    assert got.shape == (2, 5, d)
    assert_close(got, block(x, mod, rope, attend)[0][:, 3:8], 1e-6)
    other = jnp.asarray(rng.standard_normal((2, d)), jnp.float32)
    outside = block.rows(x.at[:, 1].set(other), mod, rope, attend, 3, 8)
    assert rel_err(outside, got) > 1e-3


@pytest.mark.parametrize("per_token", [False, True])
def test_last_block_keys_values_equal_the_whole_block(models, per_token):
    """A prefill's last single block computes only its keys and values: the same as the whole block's."""
    block = last_single_block(models[0])
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((1, 9, block.width)), jnp.float32)
    mod = jnp.asarray(rng.standard_normal((1, 9 if per_token else 1, 3 * block.width)) * 0.3, jnp.float32)
    angles = rng.uniform(0, 6, (9, block.head_dim))
    rope = (jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))
    for got, want in zip(block.keys_values(x, mod, rope), block(x, mod, rope, attention)[1], strict=True):
        assert_close(got, want, 1e-6)  # of one shape, too


def test_batch_shares_one_prefill(models):
    """One prefill (no batch axis) serves a batch: each image equals its own batch-1 run."""
    ours, _ = models
    case = make_case(9, 3, ref_sizes=[(3, 3)])
    together, kv = ours_kv(ours, case)
    assert kv.double_k.ndim == 4 and kv.num_tokens == 9
    img_rope, txt_rope = ropes(ours, case.img_ids, case.txt_ids)
    for b in range(3):
        alone = forward_cached(
            ours, *jx(case.img[b : b + 1], case.txt[b : b + 1], case.t[b : b + 1]), img_rope, txt_rope, kv
        )
        assert_close(together[b : b + 1], alone, 1e-5)


torch.set_grad_enabled(False)
