"""LoRA files klein refuses, each with a message naming the problem; the spellings of a LoRA and its scale;
`klein generate --lora` through a subprocess (the PNG metadata names the LoRA, its scale and hash)."""

import dataclasses
import hashlib
import json

import numpy as np
import PIL.Image
import pytest
from safetensors.numpy import load_file, save_file

from klein.cli import main as cli
from klein.errors import CheckpointError, InputError
from klein.io import demo
from klein.lora.files import LoraInfo, parse_spec
from klein.lora.layouts import parse
from klein.lora.loading import Lora, lora_updates, read_lora
from klein.models.transformer_config import TransformerConfig
from tests.support import lora_files as lf
from tests.test_cli import run_klein

CFG = TransformerConfig.from_diffusers(demo.TRANSFORMER)  # the tiny fixture shape
SHAPES = lf.linear_shapes(CFG, "bfl")


def read_lora_tensors(tensors):
    return Lora(LoraInfo("test", 1.0, ""), parse(tensors, {}, "test"))


def load_lora(spec, cfg):
    lora = read_lora(spec)
    return lora.info, lora_updates(lora, cfg)


def refused(path, *fragments):
    with pytest.raises(CheckpointError) as caught:
        load_lora(path, CFG)
    for fragment in fragments:
        assert fragment in str(caught.value)
    return str(caught.value)


def pair(down, up):
    rng = np.random.default_rng(0)
    return rng.standard_normal(down).astype(np.float32), rng.standard_normal(up).astype(np.float32)


def test_another_model_size_names_the_key_and_both_shapes(tmp_path):
    wider = dataclasses.replace(CFG, num_attention_heads=4)  # width 64, not 32
    file = lf.write_bfl(tmp_path / "wide.safetensors", lf.random_lora(lf.linear_shapes(wider, "bfl"), 4, 0))
    refused(file, "another model size", ".lora_A.weight' has shape (4, 64)", "needs (4, 32)", "width 64")


def test_same_width_other_layer_sizes_names_the_layer_sizes(tmp_path):
    """A LoRA of this model's width whose MLP is wider: the message names the sizes that differ (it said
    "The LoRA is for width 32, the model is width 32")."""
    other = dataclasses.replace(CFG, mlp_ratio=4.0)  # the MLP's hidden layer 128 wide, not 96
    file = lf.write_bfl(tmp_path / "mlp.safetensors", lf.random_lora(lf.linear_shapes(other, "bfl"), 4, 0))
    message = refused(file, "img_mlp.0.lora_B.weight' has shape (256, 4)", "needs (192, 4)")
    assert "The layer is 256 x 32 (outputs x inputs) in the LoRA, 192 x 32 in this model" in message
    assert "width 32, the model is width 32" not in message


def test_real_sizes_are_named(tmp_path):
    """A klein-9b LoRA on klein-4b (the real configs; only shapes are built, no weights)."""
    klein_4b = TransformerConfig(num_layers=5, num_single_layers=20, num_attention_heads=24)
    file = lf.write_bfl(
        tmp_path / "9b.safetensors", {"double_blocks.0.img_attn.proj": pair((16, 4096), (4096, 16))}
    )
    with pytest.raises(
        CheckpointError, match=r"The LoRA is for klein-9b \(width 4096\), the model is klein-4b"
    ):
        load_lora(file, klein_4b)


@pytest.mark.parametrize(
    "key,model",
    [
        ("lora_unet_double_blocks_0_img_mod_lin", "FLUX.1"),
        ("transformer.transformer_blocks.0.norm1.linear", "FLUX.1"),
        ("diffusion_model.single_blocks.0.modulation.lin", "FLUX.1"),
        ("diffusion_model.guidance_in.in_layer", "FLUX.2 [dev]"),
    ],
)
def test_other_models_are_named(tmp_path, key, model):
    down, up = ("lora_down", "lora_up") if key.startswith("lora_unet") else ("lora_A", "lora_B")
    a, b = pair((4, 32), (32, 4))
    file = lf.write_bfl(tmp_path / "other.safetensors", {key: (a, b)}, names=(down, up), prefix="")
    refused(
        file, f"a LoRA for {model}", key.split(".", 1)[-1] if "." in key else key.removeprefix("lora_unet_")
    )


def test_flux2_dev_by_width(tmp_path):
    file = lf.write_bfl(
        tmp_path / "dev.safetensors", {"double_blocks.0.img_attn.proj": pair((16, 6144), (6144, 16))}
    )
    refused(file, "FLUX.2 [dev] (width 6144)")


def test_keys_that_match_nothing_are_listed(tmp_path):
    lora = lf.random_lora(SHAPES, 4, 0)
    lora["double_blocks.7.img_attn.proj"] = lora["double_blocks.0.img_attn.proj"]  # the tiny model has 2
    lora["img_attn.unknown"] = lora["double_blocks.0.img_attn.proj"]
    file = lf.write_bfl(tmp_path / "more.safetensors", lora)
    refused(
        file,
        "2 LoRA keys match no layer",
        "BFL / ai-toolkit layout",
        "diffusion_model.double_blocks.7.img_attn.proj",
        "diffusion_model.img_attn.unknown",
    )


def test_text_encoder_loras_are_named(tmp_path):
    lora = lf.random_lora({"transformer_blocks.0.attn.to_q": (32, 32)}, 4, 0)
    file = lf.write_peft(tmp_path / "both.safetensors", lora)
    tensors = load_file(str(file))
    tensors["text_encoder.layers.0.q_proj.lora_A.weight"] = np.ones((4, 32), np.float32)
    tensors["text_encoder.layers.0.q_proj.lora_B.weight"] = np.ones((32, 4), np.float32)
    save_file(tensors, str(file))
    refused(file, "1 LoRA key matches no layer", "text_encoder.layers.0.q_proj", "not text encoder ones")


def test_not_a_lora(tmp_path, tiny_transformer):
    folder, _ = tiny_transformer
    refused(
        folder / "transformer" / "diffusion_pytorch_model.safetensors", "not a LoRA file", "full transformer"
    )
    (tmp_path / "notes.safetensors").write_text("not tensors")
    refused(tmp_path / "notes.safetensors", "not a readable safetensors file")
    refused(tmp_path / "absent.safetensors", "LoRA", "no such file")
    refused("/dev/zero", "LoRA /dev/zero: not a file or a folder", "a .safetensors file")


@pytest.mark.parametrize(
    "suffixes,kind",
    [
        ((".oft_blocks",), "OFT"),
        ((".lora_A.weight", ".lora_B.weight", ".lora_B.bias"), "LoRA with biases"),
        ((".diff",), "full weight differences"),
        ((".a1.weight", ".a2.weight", ".b1.weight", ".b2.weight"), "GLoRA"),
        ((".weight", ".on_input"), "(IA)^3"),
    ],
)
def test_unsupported_adapter_kinds_are_refused_by_name(tmp_path, suffixes, kind):
    """LoHa, LoKr and DoRA are read (tests/test_lora_kinds.py); these kinds are not."""
    file = tmp_path / "adapter.safetensors"
    save_file({f"diffusion_model.img_in{s}": np.ones((4, 4), np.float32) for s in suffixes}, str(file))
    refused(file, f"a {kind}", "klein applies LoRA, LoCon, LoHa, LoKr and DoRA adapters only")


def test_spellings_of_a_lora_and_its_scale(tmp_path):
    assert parse_spec("style.safetensors") == ("style.safetensors", 1.0)
    assert parse_spec("style.safetensors:0.8") == ("style.safetensors", 0.8)
    assert parse_spec(("style.safetensors", 2)) == ("style.safetensors", 2.0)
    assert parse_spec("owner/repo:-0.5") == ("owner/repo", -0.5)
    colon = tmp_path / "a:1"
    colon.write_bytes(b"")
    assert parse_spec(str(colon)) == (str(colon), 1.0)  # an existing path keeps its colon
    for bad in [("x", "strong"), ("x", float("nan")), ("x", 1, 2), 3]:
        with pytest.raises(InputError, match="LoRA"):
            parse_spec(bad)


def test_folder_with_one_file_and_scales_from_the_file(tmp_path):
    shapes = {"double_blocks.0.img_attn.qkv": SHAPES["double_blocks.0.img_attn.qkv"]}
    lf.write_kohya(tmp_path / "only.safetensors", lf.random_lora(shapes, 4, 0), alpha=1.0)
    info, updates = load_lora(f"{tmp_path}:0.5", CFG)
    assert info.scale == 0.5 and info.name == str(tmp_path)
    assert len(updates) == 3 and {u.scale for u in updates} == {0.25}  # musubi's alpha 1 over rank 4
    lf.write_kohya(tmp_path / "second.safetensors", lf.random_lora(shapes, 4, 0), alpha=1.0)
    refused(tmp_path, "exactly one .safetensors file", "only.safetensors, second.safetensors")


def test_cli_lora_writes_its_name_scale_and_hash(klein_home, tmp_path):
    file = lf.write_bfl(tmp_path / "style.safetensors", lf.random_lora(SHAPES, 4, 0))
    out = tmp_path / "fox.png"
    args = ["--prompt", "a fox", "--steps", "1", "--height", "32", "--width", "32", "--seed", "1"]
    result = run_klein(klein_home, "generate", *args, "--lora", f"{file}:0.5", "--out", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    assert json.loads(PIL.Image.open(out).text["loras"]) == [
        {"name": str(file), "scale": 0.5, "sha256": digest}
    ]
    assert f"LoRA {file}:0.5 (sha256 {digest[:12]})" in result.stderr


def test_cli_bad_lora_is_a_clean_error(klein_home, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    wide = dataclasses.replace(CFG, num_attention_heads=4)
    bad = lf.write_bfl(tmp_path / "wide.safetensors", lf.random_lora(lf.linear_shapes(wide, "bfl"), 4, 0))
    out = tmp_path / "x.png"
    assert cli.main(["generate", "--prompt", "a fox", "--lora", str(bad), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert f"error: LoRA {bad}: made for another model size" in error and "Traceback" not in error
    assert not out.exists()


def test_kohya_style_diffusers_names():
    """OneTrainer's `lora_transformer_` keys: diffusers module names with `_` for `.`."""
    lora = read_lora_tensors(
        {
            "lora_transformer_transformer_blocks_1_attn_to_add_out.lora_down.weight": np.ones(
                (2, 32), np.float32
            ),
            "lora_transformer_transformer_blocks_1_attn_to_add_out.lora_up.weight": np.ones(
                (32, 2), np.float32
            ),
            "lora_transformer_transformer_blocks_1_attn_to_add_out.alpha": np.array(1.0, np.float32),
        }
    )
    (update,) = lora_updates(lora, CFG)
    assert update.path == ("transformer_blocks", "attn", "to_add_out", "kernel") and update.layer == 1
    assert update.scale == 0.5 and lora.parsed.layout.startswith("kohya-style")
