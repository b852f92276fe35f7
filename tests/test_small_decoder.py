"""FLUX.2-small-decoder: a decoder narrower than its encoder, in each form it ships in (a diffusers folder,
BFL's whole file, BFL's decoder alone completed by the model's own VAE), against diffusers; through
`--vae` and `vae=`; and in the memory plan."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLFlux2
from flax import nnx

import klein
from klein.cli import main as cli
from klein.errors import CheckpointError
from klein.io import demo
from klein.io.vae_checkpoint import load_vae, load_vae_file, vae_config
from klein.models import vae as flax_vae
from tests.support.bfl_files import vae_to_bfl, write_safetensors
from tests.support.compare import assert_close, rel_err
from tests.support.strengthen import strengthen_
from tests.support.tiny_vae import build_vae

TOL = 1e-4  # as tests/test_vae.py: torch against JAX fp32 rounding is ~1e-6
# The released decoder's widths are 3/4 of the encoder's ([96, 192, 384, 384] under [128, 256, 512, 512]).
ENCODER = (16, 32, 64, 64)
SMALL = dict(block_out_channels=ENCODER, decoder_block_out_channels=(12, 24, 48, 48), norm_num_groups=4)
DEMO_SMALL = (8, 8, 16, 16)  # a decoder for the demo's VAE (GroupNorms of 8 groups)

encode_mean = nnx.jit(lambda vae, images: vae.encode_mean(images))
decode = nnx.jit(lambda vae, z: vae.decode(z))


def encoder_part(model) -> dict:
    """The weights a decoder-only file leaves to the model's own VAE: encoder, quant conv, statistics."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(("decoder.", "post_quant_conv."))}


def write_forms(folder, model, own: AutoencoderKLFlux2) -> dict:
    """`model` as FLUX.2-small-decoder ships it: its own diffusers folder aside, BFL's whole file and BFL's
    decoder alone (keys without `decoder.`); `own` (the model's own VAE, sharing the encoder) saved beside."""
    own.save_pretrained(folder / "own")
    bfl = vae_to_bfl(model)
    bare = {k.removeprefix("decoder."): v for k, v in bfl.items() if k.startswith("decoder.")}
    return dict(
        own=folder / "own",
        whole=write_safetensors(folder / "full_encoder_small_decoder.safetensors", bfl),
        bare=write_safetensors(folder / "small_decoder.safetensors", bare),
    )


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(the diffusers small-decoder VAE, its forms, the model's own full-width VAE sharing its encoder)."""
    folder = tmp_path_factory.mktemp("small-decoder")
    model = build_vae(folder, **SMALL)  # the diffusers folder: folder/vae
    own = build_vae(folder / "own-build", seed=1, block_out_channels=ENCODER, norm_num_groups=4)
    own.load_state_dict(encoder_part(model), strict=False)
    forms = write_forms(folder, model, own)
    return model, dict(folder=folder / "vae", **forms), own


def loaded(forms: dict, form: str) -> flax_vae.AutoencoderKLFlux2:
    if form == "folder":
        return load_vae(forms["folder"])
    return load_vae_file(forms[form], own=forms["own"])


def nchw(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())


def nhwc(x: torch.Tensor) -> np.ndarray:
    return x.detach().numpy().transpose(0, 2, 3, 1)


@pytest.mark.parametrize("form", ["folder", "whole", "bare"])
def test_widths_are_read_from_each_form(small, form):
    model, forms, _ = small
    assert vae_config(forms[form], forms["own"]) == flax_vae.VAEConfig.from_diffusers_config(
        dict(model.config)
    )
    assert vae_config(forms["own"]).decoder_block_out_channels is None


@pytest.mark.parametrize("form", ["folder", "whole", "bare"])
@torch.no_grad()
def test_each_form_decodes_as_diffusers(small, form):
    """(The encoder of the decoder-only form, the model's own, is checked through `vae=` below.)"""
    model, forms, own = small
    z = np.random.default_rng(0).standard_normal((1, 6, 4, 32)).astype(np.float32)
    want = nhwc(model.decode(nchw(z)).sample)
    assert_close(decode(loaded(forms, form), jnp.asarray(z)), want, TOL)
    # Not vacuous: the model's own (full-width) decoder draws another image from the same latents.
    assert rel_err(nhwc(own.decode(nchw(z)).sample), want) > 30 * TOL


def test_a_decoder_alone_needs_the_models_vae(small, klein_home, tmp_path, monkeypatch, capsys):
    _, forms, _ = small
    with pytest.raises(CheckpointError, match="decoder alone.*name the model too"):
        load_vae_file(forms["bare"])
    # Every part named, none from a model: the decoder has no encoder to go with it; found before loading.
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    checkpoint = demo.ensure_demo()
    parts = [f"--{part.replace('_', '-')}={checkpoint / part}" for part in ("transformer", "text_encoder")]
    args = ["generate", *parts, f"--tokenizer={checkpoint / 'tokenizer'}", f"--vae={forms['bare']}"]
    assert cli.main([*args, "--prompt", "x", "--out", str(tmp_path / "x.png")]) == 2
    printed = capsys.readouterr()
    assert "small_decoder.safetensors: a VAE decoder alone" in printed.err
    assert "Traceback" not in printed.err and not (tmp_path / "x.png").exists()


@pytest.fixture(scope="module")
def demo_small(klein_home, tmp_path_factory):
    """The demo's VAE with a narrower random decoder, as the two BFL files."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(klein_home))
        own = AutoencoderKLFlux2.from_pretrained(demo.ensure_demo() / "vae")
    model = AutoencoderKLFlux2(**dict(own.config, decoder_block_out_channels=DEMO_SMALL))
    strengthen_(model, 2)
    model.load_state_dict(encoder_part(own), strict=False)
    return model, write_forms(tmp_path_factory.mktemp("demo-small"), model, own)


@torch.no_grad()
def test_vae_takes_the_decoder_alone_with_the_models_encoder(demo_small, klein_home, monkeypatch):
    """`vae=` (as `--vae`, `klein serve --vae` and `from_pretrained(vae=)`: one `LoadOptions` field): the
    decoder alone, completed by the demo's encoder and statistics, decodes and encodes as diffusers does."""
    model, forms = demo_small
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    pipe = klein.load_pipeline("demo", vae=forms["bare"])
    assert pipe.vae_config.decoder_channels == DEMO_SMALL
    vae = nnx.merge(*pipe._models["vae"].get())
    rng = np.random.default_rng(1)
    z = rng.standard_normal((1, 4, 6, 32)).astype(np.float32)
    x = rng.uniform(-1, 1, (1, 32, 48, 3)).astype(np.float32)
    assert_close(decode(vae, jnp.asarray(z)), nhwc(model.decode(nchw(z)).sample), TOL)
    assert_close(encode_mean(vae, jnp.asarray(x)), nhwc(model.encode(nchw(x)).latent_dist.mode()), TOL)


def plan_json(*flags, capsys) -> dict:
    assert cli.main(["plan", "--json", "--size", "512x512", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_counts_the_smaller_decoder(demo_small, klein_home, monkeypatch, capsys):
    model, forms = demo_small
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    full = plan_json(capsys=capsys)
    for form in ("whole", "bare"):
        planned = plan_json("--vae", str(forms[form]), capsys=capsys)
        # Every weight of the diffusers model, in the demo's float32 (the step counter is not loaded).
        count = sum(t.numel() for k, t in model.state_dict().items() if not k.endswith("num_batches_tracked"))
        assert planned["weights"]["vae"] == 4 * count < full["weights"]["vae"]
        assert planned["request_bytes"]["decode"] < full["request_bytes"]["decode"]
    assert cli.main(["plan", "--vae", str(forms["whole"].parent / "none.safetensors")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
