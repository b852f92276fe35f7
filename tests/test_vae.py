"""The Flax FLUX.2 VAE against diffusers: the model, the klein pipeline's latent paths, loading."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
from flax import nnx
from safetensors.numpy import load_file, save_file

from klein.errors import CheckpointError
from klein.io.loading import expected_shapes
from klein.io.vae_checkpoint import SKIPPED_KEYS, load_vae
from klein.models import vae as flax_vae
from klein.models import vae_canvas, vae_tiled
from tests.support.compare import assert_close, rel_err
from tests.support.tiny_vae import build_vae

# Max abs error relative to the output's max: torch vs JAX fp32 rounding is ~1e-6 here.
TOL = 1e-4

encode_mean = nnx.jit(lambda vae, images: vae.encode_mean(images))
decode = nnx.jit(lambda vae, z: vae.decode(z))
encode_latents = nnx.jit(flax_vae.encode_latents)
decode_latents = nnx.jit(flax_vae.decode_latents)
decode_latents_tiled = nnx.jit(vae_tiled.decode_latents_tiled, static_argnames=("tile", "overlap"))
encode_on_canvas = nnx.jit(flax_vae.encode_latents_on_canvas)
decode_on_canvas = nnx.jit(flax_vae.decode_latents_on_canvas)
CANVAS = 1e-5
"""float32: an image on a larger canvas against its own size differs in summation order only."""


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    """(vae folder, diffusers VAE, our VAE loaded from the folder) for the strengthened tiny VAE."""
    folder = tmp_path_factory.mktemp("tiny-vae")
    reference = build_vae(folder)
    ours = load_vae(folder / "vae")
    return folder / "vae", reference, ours


@pytest.fixture(scope="module")
def pipeline(tiny_vae):
    """A klein pipeline around the tiny VAE, to call diffusers' own latent code."""
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae[1],
        text_encoder=None,
        tokenizer=None,
        transformer=None,
    )


def nchw(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())


def nhwc(x: torch.Tensor) -> np.ndarray:
    return x.detach().numpy().transpose(0, 2, 3, 1)


def images(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (2, height, width, 3)).astype(np.float32)


def normal(*shape: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def pipeline_vae_latents(pipe: Flux2KleinPipeline, latents: np.ndarray) -> torch.Tensor:
    """The first steps of the klein pipeline's decode path: undo the BatchNorm, unpatchify."""
    vae = pipe.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return pipe._unpatchify_latents(nchw(latents) * std + mean)


@pytest.mark.parametrize("height, width", [(64, 64), (48, 96)])
@torch.no_grad()
def test_encode_and_decode_match_diffusers(tiny_vae, height, width):
    _, reference, ours = tiny_vae
    x = images(height, width)
    ref_mean = nhwc(reference.encode(nchw(x)).latent_dist.mode())
    assert_close(encode_mean(ours, jnp.asarray(x)), ref_mean, TOL)

    z = normal(2, height // 8, width // 8, 32)
    assert_close(decode(ours, jnp.asarray(z)), nhwc(reference.decode(nchw(z)).sample), TOL)


@torch.no_grad()
def test_latents_match_pipeline_encode(tiny_vae, pipeline):
    x = images(48, 96)
    ref = nhwc(pipeline._encode_vae_image(nchw(x), generator=None))
    ours = encode_latents(tiny_vae[2], jnp.asarray(x))
    assert ours.shape == (2, 3, 6, 128)
    assert_close(ours, ref, TOL)


@torch.no_grad()
def test_decode_latents_matches_pipeline_decode(tiny_vae, pipeline):
    latents = normal(2, 3, 6, 128)
    ref = nhwc(pipeline.vae.decode(pipeline_vae_latents(pipeline, latents), return_dict=False)[0])
    ours = decode_latents(tiny_vae[2], jnp.asarray(latents))
    assert ours.shape == (2, 48, 96, 3)
    assert_close(ours, ref, TOL)


@pytest.mark.parametrize("masked", [True, False])
def test_an_image_on_a_larger_canvas_encodes_and_decodes_as_at_its_own_size(tiny_vae, masked):
    """48x80 px (3x5 tokens) at the top left of a 96x128 canvas, zeros beyond: the canvas's latents and
    pixels there are those of the image's own size within `CANVAS` (every convolution, GroupNorm and the
    mid-block attention masked: `klein.models.vae_canvas`); the same canvas run plainly is not."""
    ours = tiny_vae[2]
    x, z = images(48, 80), normal(2, 3, 5, 128)
    pixels, latents = np.zeros((2, 96, 128, 3), np.float32), np.zeros((2, 6, 8, 128), np.float32)
    pixels[:, :48, :80], latents[:, :3, :5] = x, z
    extent = np.array([48, 80], np.int32)
    if masked:
        encoded, decoded = encode_on_canvas(ours, pixels, extent), decode_on_canvas(ours, latents, extent)
    else:
        encoded, decoded = encode_latents(ours, pixels), decode_latents(ours, latents)
    errors = (
        rel_err(np.asarray(encoded)[:, :3, :5], encode_latents(ours, x)),
        rel_err(np.asarray(decoded)[:, :48, :80], decode_latents(ours, z)),
    )
    if masked:
        assert max(errors) < CANVAS, errors
    else:
        assert min(errors) > 1e-3, errors


def test_a_canvas_is_its_images_size_rounded_up_to_a_few_classes():
    """Every side a multiple of 64 px (of 128 beyond 1024, 256 beyond 2048), the padding under 64 px up to
    1024 and under an eighth of the side beyond 512, and a class runs on itself: 1024 px sides are 16
    classes where 16 px steps were 64."""
    sides = range(16, 4097, 16)
    assert vae_canvas.canvas_size(656, 992) == (704, 1024)  # a 1000x667 photo, prepared
    assert [vae_canvas.canvas_side(n) for n in (16, 48, 64, 80, 240, 528, 1040, 2064)] == [
        64,
        64,
        64,
        128,
        256,
        576,
        1152,
        2304,
    ]
    for n in sides:
        side = vae_canvas.canvas_side(n)
        assert side >= n and side % 64 == 0 and vae_canvas.canvas_side(side) == side, n
        assert side - n < (64 if n <= 1024 else n / 8), n
    assert len({vae_canvas.canvas_side(n) for n in sides if n <= 1024}) == 16


def _scaled(vae, path: str, index, factor: float):
    """A copy of `vae` with the parameter at dotted `path` multiplied by `factor` at `index`."""
    vae = nnx.clone(vae)
    variable = vae
    for name in path.split("."):
        variable = variable[int(name)] if name.isdigit() else getattr(variable, name)
    variable[...] = variable[...].at[index].multiply(factor)
    return vae


@torch.no_grad()
def test_parity_is_not_vacuous(tiny_vae, pipeline):
    """Small edits to the pieces a port most often gets wrong move the outputs far past TOL."""
    _, reference, ours = tiny_vae
    x = jnp.asarray(images(64, 64))
    ref_latents = nhwc(pipeline._encode_vae_image(nchw(x), generator=None))
    latents = normal(1, 4, 4, 128)
    ref_images = nhwc(reference.decode(pipeline_vae_latents(pipeline, latents)).sample)

    one_bn_var = _scaled(ours, "bn.running_var", 7, 1.5)
    assert rel_err(encode_latents(one_bn_var, x), ref_latents) > 30 * TOL
    assert rel_err(decode_latents(one_bn_var, jnp.asarray(latents)), ref_images) > 30 * TOL
    for path in ("encoder.mid_block.attentions.0.to_q.kernel", "decoder.mid_block.attentions.0.to_q.kernel"):
        edited = _scaled(ours, path, ..., 1.1)
        err = max(
            rel_err(encode_latents(edited, x), ref_latents),
            rel_err(decode_latents(edited, latents), ref_images),
        )
        assert err > 30 * TOL, path


@torch.no_grad()
def test_tiled_decode_is_as_close_to_plain_as_diffusers_tiling(tiny_vae, pipeline, monkeypatch):
    """Tiles normalise and attend locally, so tiling is not exact; diffusers' tiling sets the bar.

    Both use 128 px tiles with a 32 px blend here (their 1024 / 256 px defaults scaled to the fixture).
    """
    _, reference, ours = tiny_vae
    latents = normal(1, 16, 24, 128)
    plain = np.asarray(decode_latents(ours, jnp.asarray(latents)))
    one_tile = decode_latents_tiled(ours, jnp.asarray(latents), tile=24, overlap=4)
    assert_close(one_tile, plain, 1e-6)

    tiled = np.asarray(decode_latents_tiled(ours, jnp.asarray(latents), tile=8, overlap=2))
    monkeypatch.setattr(reference, "tile_sample_min_size", 128)
    monkeypatch.setattr(reference, "tile_latent_min_size", 16)
    ref_tiled = nhwc(reference.tiled_decode(pipeline_vae_latents(pipeline, latents)).sample)
    assert rel_err(ref_tiled, plain) > 30 * TOL  # the comparison below is not between identical outputs
    assert rel_err(tiled, plain) <= rel_err(ref_tiled, plain)
    assert np.sqrt(np.mean((tiled - plain) ** 2)) <= np.sqrt(np.mean((ref_tiled - plain) ** 2))


def test_real_config_matches_the_loader():
    """diffusers' default AutoencoderKLFlux2 is the released FLUX.2 VAE: same keys and shapes, exactly."""
    with init_empty_weights():
        reference = AutoencoderKLFlux2()
    state = reference.state_dict()
    assert SKIPPED_KEYS <= state.keys()
    want = {key: tuple(tensor.shape) for key, tensor in state.items() if key not in SKIPPED_KEYS}

    cfg = flax_vae.VAEConfig.from_diffusers_config(dict(reference.config))
    assert cfg == flax_vae.VAEConfig.flux2()
    abstract = nnx.eval_shape(lambda: flax_vae.AutoencoderKLFlux2(cfg, rngs=nnx.Rngs(0)))
    assert expected_shapes(abstract) == want


def test_missing_key_is_reported(tiny_vae, tmp_path):
    folder, _, _ = tiny_vae
    missing = "decoder.mid_block.attentions.0.to_q.weight"
    tensors = load_file(folder / "diffusion_pytorch_model.safetensors")
    del tensors[missing]
    save_file(tensors, tmp_path / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_vae(tmp_path)


def test_unsupported_config_is_rejected():
    with pytest.raises(CheckpointError, match="act_fn"):
        flax_vae.VAEConfig.from_diffusers_config({"act_fn": "relu"})


def _upsample_by_repeat(upsample: flax_vae.Upsample, x: jax.Array) -> jax.Array:
    """The plain formulation: build the 4x nearest-neighbour image, then the 3x3 conv."""
    return upsample.conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_subpixel_upsample_equals_repeat_then_conv(dtype, tol):
    """Four 2x2 convs on the low-resolution input + depth-to-space == repeat 2x + 3x3 conv, borders
    included (odd, unequal sides), up to one bf16 rounding; a change of one corner tap (1% in float32)
    moves the output past the tolerance."""
    upsample = flax_vae.Upsample(6, rngs=nnx.Rngs(0), param_dtype=dtype)
    upsample.conv.bias[...] = jnp.asarray(normal(6, seed=3), dtype)
    x = jnp.asarray(normal(2, 5, 7, 6, seed=2), dtype)
    ours = np.asarray(upsample(x), np.float32)
    assert ours.shape == (2, 10, 14, 6) and upsample(x).dtype == dtype
    assert_close(ours, np.asarray(_upsample_by_repeat(upsample, x), np.float32), tol)
    edited = _scaled(upsample, "conv.kernel", (0, 2), 1.01 if dtype == jnp.float32 else 2.0)
    assert rel_err(ours, np.asarray(_upsample_by_repeat(edited, x), np.float32)) > 10 * tol


def _group_norm_float64(norm, x) -> np.ndarray:
    """GroupNorm in float64, two passes: the reference both float32 formulations are measured against."""
    x = np.asarray(x, np.float64)
    b, c, g = x.shape[0], x.shape[-1], norm.num_groups
    grouped = x.reshape(b, -1, g, c // g)
    mean, var = grouped.mean((1, 3), keepdims=True), grouped.var((1, 3), keepdims=True)
    y = ((grouped - mean) / np.sqrt(var + norm.epsilon)).reshape(x.shape)
    return y * np.asarray(norm.scale[...], np.float64) + np.asarray(norm.bias[...], np.float64)


@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_one_pass_group_norm_equals_two_pass(offset):
    """Per-channel shifted sums + law of total variance: as close to float64 as Flax's two-pass GroupNorm,
    also on activations whose mean is 100 standard deviations from zero, where E[x^2] - E[x]^2 fails."""
    norm = flax_vae.GroupNorm(12, 4, epsilon=1e-6, use_fast_variance=False, rngs=nnx.Rngs(0))
    norm.scale[...] = jnp.asarray(1 + normal(12, seed=4) * 0.5)
    norm.bias[...] = jnp.asarray(normal(12, seed=5))
    x = jnp.asarray(normal(2, 9, 11, 12, seed=6) * 3 + offset)
    exact = _group_norm_float64(norm, x)
    ours, two_pass = norm(x), nnx.GroupNorm.__call__(norm, x)
    assert rel_err(ours, exact) <= 2 * rel_err(two_pass, exact) + 1e-6
    assert_close(ours, two_pass, 3e-5)
    naive = nnx.GroupNorm(12, 4, epsilon=1e-6, use_fast_variance=True, rngs=nnx.Rngs(0))
    naive.scale[...], naive.bias[...] = norm.scale[...], norm.bias[...]
    assert rel_err(naive(x), exact) > (1e-3 if offset else 0.0)
    assert rel_err(ours, _group_norm_float64(_scaled(norm, "scale", 5, 1.01), x)) > 1e-3


def test_pixels_per_token_come_from_the_config():
    """16 = 8x downsampling x the 2x2 patch; a VAE of three levels downsamples 4x: 8 px per token. The
    constant that request validation uses is the released VAE's."""
    assert flax_vae.VAEConfig.flux2().pixels_per_token == flax_vae.PIXELS_PER_TOKEN == 16
    assert flax_vae.VAEConfig(block_out_channels=(32, 64, 64)).pixels_per_token == 8
