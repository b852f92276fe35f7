"""The transformer against diffusers on sequences longer than one attention tile: more queries than
`QUERY_BLOCK` and more keys than `KEY_BLOCK`, so that the blocked online softmax of
`klein.models.attention` folds several key blocks (rescaling its running max and sum) inside the whole
model, in text-to-image, standard editing and KV editing (prefill, then a cached step)."""

import jax
import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
)
from flax import nnx

from klein.io.transformer_checkpoint import load_transformer
from klein.models import transformer as T
from klein.models.attention import KEY_BLOCK, QUERY_BLOCK
from tests.support.compare import assert_close
from tests.support.transformer_inputs import jx, make_case, ropes, torch_call

TOL = 1e-4  # as tests/test_transformer_parity.py: fp32 on both sides
IMAGE = (48, 48)  # 2304 image tokens
REFERENCE = [(40, 40)]  # 1600 reference tokens beside a 24 x 24 image


@pytest.fixture(scope="module")
def models(tiny_transformer):
    folder, reference = tiny_transformer
    for block in reference.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in reference.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    return load_transformer(folder / "transformer"), reference


def jitted(fn, model):
    """`fn(model, *args)` compiled whole: dispatching these long sequences op by op costs three times more."""
    graphdef, state = nnx.split(model)
    compiled = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
    return lambda *args: compiled(state, *args)


def longer_than_a_tile(case):
    keys = case.txt.shape[1] + case.img.shape[1] + (0 if case.ref is None else case.ref.shape[0])
    assert keys > KEY_BLOCK and case.img.shape[1] > QUERY_BLOCK
    return case


def test_text_to_image(models):
    ours, reference = models
    case = longer_than_a_tile(make_case(20, 1, hw=IMAGE))
    img_rope, txt_rope = ropes(ours, case.img_ids, case.txt_ids)
    got = jitted(T.forward, ours)(*jx(case.img, case.txt, case.t), img_rope, txt_rope)
    assert_close(got, torch_call(reference, case)[0].numpy(), TOL)


def test_standard_references(models):
    ours, reference = models
    case = longer_than_a_tile(make_case(21, 1, hw=(24, 24), ref_sizes=REFERENCE))
    img_rope, txt_rope, ref_rope = ropes(ours, case.img_ids, case.txt_ids, case.ref_ids)
    forward = jitted(lambda model, *args: T.forward(model, *args[:5], refs=args[5:]), ours)
    got = forward(*jx(case.img, case.txt, case.t), img_rope, txt_rope, case.ref[None], ref_rope)
    joint = np.concatenate([case.img, case.ref[None]], axis=1)
    ids = np.concatenate([case.img_ids, case.ref_ids])
    want = torch_call(reference, case, img=joint, img_ids=ids)[0].numpy()[:, : case.img.shape[1]]
    assert_close(got, want, TOL)


def test_kv_prefill_and_a_cached_step(models):
    ours, reference = models
    case = longer_than_a_tile(make_case(22, 1, hw=(24, 24), ref_sizes=REFERENCE))
    joint = np.concatenate([case.ref[None], case.img], axis=1)
    ids = np.concatenate([case.ref_ids, case.img_ids])
    kwargs = dict(kv_cache_mode="extract", num_ref_tokens=case.ref.shape[0])
    want, cache = torch_call(reference, case, img=joint, img_ids=ids, **kwargs)
    img_rope, txt_rope, ref_rope = ropes(ours, case.img_ids, case.txt_ids, case.ref_ids)
    kv = jitted(T.prefill, ours)(jx(case.ref)[0], ref_rope)
    cached = jitted(T.forward_cached, ours)
    assert_close(cached(*jx(case.img, case.txt, case.t), img_rope, txt_rope, kv), want.numpy(), TOL)
    later = make_case(23, 1, hw=(24, 24), t=[0.3])
    want = torch_call(reference, later, kv_cache=cache, kv_cache_mode="cached")[0].numpy()
    assert_close(cached(*jx(later.img, later.txt, later.t), img_rope, txt_rope, kv), want, TOL)


torch.set_grad_enabled(False)
