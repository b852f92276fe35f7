"""`klein generate` with parts named one by one: the demo gives the parts not named (as --model's help says),
a named part that is missing is named, and a single-file VAE that does not fit its model says where its
model comes from."""

import PIL.Image
import pytest

from klein.cli import main as cli
from klein.io import demo
from tests.support.bfl_files import vae_to_bfl, write_safetensors
from tests.support.tiny_vae import build_vae

SMALL = ["--prompt", "a fox", "--steps", "1", "--height", "32", "--width", "48"]


@pytest.fixture
def demo_folder(klein_home, monkeypatch):
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    return demo.ensure_demo()


def generate(*args, capsys) -> tuple[int, str]:
    code = cli.main(["generate", *map(str, args)])
    return code, capsys.readouterr().err


def test_a_vae_alone_runs_with_the_demos_other_parts(demo_folder, tmp_path, capsys):
    out = tmp_path / "fox.png"
    code, err = generate("--vae", demo_folder / "vae", *SMALL, "--out", out, capsys=capsys)
    assert code == 0, err
    with PIL.Image.open(out) as image:
        assert image.size == (48, 32) and "demo" in image.text["model"]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--transformer", "{tmp}/gone.safetensors"], "gone.safetensors: no such file (the transformer)"),
        (["--vae", "{tmp}/gone-vae"], "gone-vae: no such file or folder (the vae)"),
        (["--text-encoder", "{tmp}/qwen.gguf"], "qwen.gguf: no such file (the text encoder)"),
    ],
)
def test_a_missing_part_is_named(demo_folder, tmp_path, capsys, args, said):
    code, err = generate(*(arg.format(tmp=tmp_path) for arg in args), *SMALL, capsys=capsys)
    assert code == 2 and said in err and "no model to take" not in err, err
    assert "Traceback" not in err


def test_a_transformer_alone_is_told_the_demo_does_not_complete_it(demo_folder, capsys):
    code, err = generate("--transformer", demo_folder / "transformer", *SMALL, capsys=capsys)
    assert code == 2
    assert "no model to take the text_encoder, vae from" in err and "fit only the demo's transformer" in err


def test_a_flux2_decoder_on_the_demo_says_what_to_give(demo_folder, tmp_path_factory, capsys):
    """FLUX.2-small-decoder's decoder alone has FLUX.2's layers per level (2, the demo's VAE has 1): the
    demo's VAE cannot complete it. Said in words, with where the files and the model come from."""
    folder = tmp_path_factory.mktemp("flux2-like")
    model = build_vae(
        folder,
        block_out_channels=(32, 64, 128, 128),
        decoder_block_out_channels=(24, 48, 96, 96),
        layers_per_block=2,
    )
    decoder = {
        k.removeprefix("decoder."): v for k, v in vae_to_bfl(model).items() if k.startswith("decoder.")
    }
    file = write_safetensors(folder / "small_decoder.safetensors", decoder)
    code, err = generate("--vae", file, *SMALL, "--out", folder / "x.png", capsys=capsys)
    assert code == 2 and "Traceback" not in err
    for said in (
        "small_decoder.safetensors: a single-file VAE takes its config",
        "do not fit it (32 unexpected keys)",
        "https://huggingface.co/black-forest-labs/FLUX.2-small-decoder",
        "black-forest-labs/FLUX.2-klein-4B",
    ):
        assert said in err, err
    assert not (folder / "x.png").exists()
