"""Parity grid: our transformer against diffusers' on generated configs, in every way klein runs it.

The configs are generated, not listed: every pair of 1, 2 or 3 double blocks and 1, 2 or 3 single blocks
(with one single block, the last block runs alone and the scan over the ones before it is empty), and
across them two head sizes, two rope axis splits per head size and two text widths (one not a
multiple of the model width), each combination of those three at least once. Each config runs in each
mode: text-to-image, standard editing (references, full attention), a KV prefill with its cached step 0
and a later cached step, and a guided (CFG, base) Euler step. A config diffusers itself rejects is skipped
with diffusers' message.

Sensitive (issue 35): with the last single block's rows taken one token early, every case fails (max abs
error about 5); with a cached step's last single block reading the reference keys of the layer before,
the KV case of every config with two or more single blocks fails (0.09 to 0.13). With `stacks.scan` as it
was, the KV case of every config with one single block raised a TypeError.
"""

import itertools

import numpy as np
import pytest
import torch

from klein.io.transformer_checkpoint import load_transformer
from klein.pipeline import denoise
from tests.support.compare import max_abs
from tests.support.tiny_transformer import build_transformer, with_kv_processors
from tests.support.transformer_inputs import (
    diffusers_extract,
    diffusers_references,
    forward,
    forward_cached,
    jx,
    make_case,
    ours_kv,
    ours_plain,
    ropes,
    torch_call,
)

TOL = 2e-3  # max abs error, float32 on both sides
BLOCKS = list(itertools.product((1, 2, 3), (1, 2, 3)))  # (double, single)
ROPE_SPLITS = {16: ((4, 4, 4, 4), (2, 6, 6, 2)), 24: ((6, 6, 6, 6), (2, 10, 8, 4))}  # head dim -> splits
TEXT_WIDTHS = (96, 100)  # model widths are 32 and 48 (two heads): 100 is a multiple of neither


def grid() -> list[dict]:
    """The configs: every block pair; bit k of its index picks the head size (k = 0), the rope split
    (k = 1) and the text width (k = 2), so the nine configs hold all eight shape combinations."""
    configs = []
    for i, (double, single) in enumerate(BLOCKS):
        head_dim = tuple(ROPE_SPLITS)[i & 1]
        configs.append(
            dict(
                num_layers=double,
                num_single_layers=single,
                attention_head_dim=head_dim,
                axes_dims_rope=ROPE_SPLITS[head_dim][i >> 1 & 1],
                joint_attention_dim=TEXT_WIDTHS[i >> 2 & 1],
            )
        )
    return configs


def config_id(config: dict) -> str:
    split = "-".join(map(str, config["axes_dims_rope"]))
    return (
        f"d{config['num_layers']}s{config['num_single_layers']}-head{config['attention_head_dim']}"
        f"-rope{split}-text{config['joint_attention_dim']}"
    )


CONFIGS = grid()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build-once factory: (ours, diffusers' model) for a config, or pytest.skip with diffusers' reason."""
    models = {}

    def get(config: dict):
        name = config_id(config)
        if name not in models:
            models[name] = _build(tmp_path_factory.mktemp(name), config)
        if isinstance(models[name], str):
            pytest.skip(f"diffusers rejects {name}: {models[name]}")
        return models[name]

    return get


def _build(folder, config: dict):
    """(ours, diffusers') for `config`, or diffusers' message where it refuses to build or run it."""
    try:
        reference = with_kv_processors(build_transformer(folder, **config))
        torch_call(reference, make_case(0, 1, hw=(1, 1), n_txt=1, width=config["joint_attention_dim"]))
    except (AssertionError, ValueError, RuntimeError) as exc:
        return str(exc) or type(exc).__name__
    return load_transformer(folder / "transformer"), reference


def case_for(config: dict, seed: int, batch: int, **kwargs):
    return make_case(seed, batch, width=config["joint_attention_dim"], **kwargs)


def check(got, want) -> None:
    err = max_abs(got, want)
    assert err < TOL, f"max abs error {err:.3g} (max |want| {float(np.abs(want).max()):.3g})"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_text_to_image(built, config):
    ours, reference = built(config)
    case = case_for(config, 0, 2)
    check(ours_plain(ours, case), torch_call(reference, case)[0].numpy())


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_standard_editing(built, config):
    ours, reference = built(config)
    case = case_for(config, 1, 1, ref_sizes=[(2, 3), (3, 2)])
    (ref_rope,) = ropes(ours, case.ref_ids)
    check(ours_plain(ours, case, refs=(case.ref[None], ref_rope)), diffusers_references(reference, case))


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_kv_prefill_and_cached_steps(built, config):
    """The prefill's keys and values, layer by layer; the cached step 0; a later cached step."""
    ours, reference = built(config)
    case = case_for(config, 2, 1, ref_sizes=[(3, 3)])
    want, cache = diffusers_extract(reference, case)
    got, kv = ours_kv(ours, case)
    check(got, want)
    layers = [(kv.double_k, kv.double_v, cache.double_block_caches)]
    layers.append((kv.single_k, kv.single_v, cache.single_block_caches))
    for ks, vs, caches in layers:
        assert len(ks) == len(vs) == len(caches)
        for k, v, layer in zip(ks, vs, caches, strict=True):
            k_want, v_want = (x.numpy()[0] for x in layer.get())
            check(k, k_want)
            check(v, v_want)
    later = case_for(config, 3, 1, t=[0.4])
    img_rope, txt_rope = ropes(ours, later.img_ids, later.txt_ids)
    got = forward_cached(ours, *jx(later.img, later.txt, later.t), img_rope, txt_rope, kv)
    check(got, torch_call(reference, later, kv_cache=cache, kv_cache_mode="cached")[0].numpy())


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_guided_step(built, config):
    """A base variant's guided Euler step (prompt and negative as one doubled batch) against diffusers'
    two calls, combined and stepped as its pipeline and scheduler do."""
    ours, reference = built(config)
    case = case_for(config, 4, 2)  # txt: [prompt; negative]
    x, sigma, sigma_next, scale = case.img[:1], 0.7, 0.55, 4.0
    rope = tuple(ropes(ours, case.img_ids, case.txt_ids))
    got = denoise.step_cfg(velocity, ours, *jx(x, case.txt), sigma, sigma_next, rope, None, scale)
    case.t = np.full(1, sigma, np.float32)
    cond, uncond = (torch_call(reference, case, img=x, txt=txt)[0].numpy() for txt in np.split(case.txt, 2))
    check(got, x + (sigma_next - sigma) * (uncond + scale * (cond - uncond)))


def velocity(model, x, txt, t, ropes, cond):
    """`denoise.velocity_text` through the compiled `forward` that text-to-image ran at the same shapes."""
    return forward(model, x, txt, t, *ropes, refs=None)


torch.set_grad_enabled(False)
