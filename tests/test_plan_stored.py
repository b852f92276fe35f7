"""The planner's weights as stored (issue 33): each Param at its own dtype and shape in the model the loader
fills, quantized files at their own bytes per weight (read from their headers), the 8, 10 and 12 GB cards
`klein plan --device` knows; and the quantized files `benchmarks/checkpoints/real_size.py --quantized` writes, at a
tiny geometry (their names, shapes and types)."""

import json
import math
import sys
from fractions import Fraction
from pathlib import Path

import gguf
import numpy as np
import pytest
from flax import nnx

from klein import devices, sharding
from klein.cli import main as cli
from klein.io import demo
from klein.io.block_forms import layer_bytes
from klein.io.gguf_file import GGUFSource
from klein.io.safetensors import TensorSource
from klein.io.text_encoder_gguf import EMBEDDING
from klein.io.transformer_file import file_config, load_transformer_file
from klein.memory import plan, stored
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.pipeline.loading import load_pipeline
from klein.request import planning

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "checkpoints"))
import quantized_files as files  # noqa: E402

TINY = TransformerConfig(
    num_layers=1,
    num_single_layers=2,
    num_attention_heads=2,
    joint_attention_dim=256,
    in_channels=128,
)
TINY_TEXT = Qwen3Config(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=28,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SINGLE = sharding.abstract_mesh("single")


def models(cfg=TINY, text=TINY_TEXT) -> plan.Models:
    return plan.Models(cfg, text, plan.FLUX2_VAE, plan.published("klein-4b", "bfloat16").variant)


def nbytes(module) -> int:
    return sum(
        v.get_value().size * v.get_value().dtype.itemsize for _, v in nnx.to_flat_state(nnx.state(module))
    )


@pytest.mark.parametrize(
    "itemsize,fp8,compute", [(2, False, "bf16"), (4, False, "int8"), (2, True, "bf16"), (2, False, "fp8")]
)
def test_transformer_bytes_are_the_stored_models_params(itemsize, fp8, compute):
    """Bytes as stored: the planner's transformer is the sum of dtype x shape of every Param of the model
    the loader fills (8-bit kernels, their float32 scales, the other weights in the dtype)."""
    sizes = plan.model_bytes(TINY, TINY_TEXT, plan.FLUX2_VAE, SINGLE, itemsize, fp8, compute)
    model = plan.stored_transformer(TINY, itemsize, fp8, compute)
    assert sizes["transformer"] == nbytes(model)
    kinds = {str(v.get_value().dtype) for _, v in nnx.to_flat_state(nnx.state(model))}
    plain = plan.model_bytes(TINY, TINY_TEXT, plan.FLUX2_VAE, SINGLE, itemsize)["transformer"]
    if fp8 or compute != "bf16":
        assert {"float32", "float8_e4m3fn" if compute != "int8" else "int8"} <= kinds
        assert sizes["transformer"] < plain
    else:
        assert (
            sizes["transformer"]
            == plain
            == sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(model))) * itemsize
        )


def test_format_table_is_ggmls_and_a_q4_0_plan_is_smaller_by_its_ratio():
    for name in stored.FORMATS.values():
        if name in gguf.GGMLQuantizationType.__members__:
            values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
            rate = Fraction(layer_bytes(name, 1, values), values)  # as the planner counts a row of blocks
            assert rate == Fraction(size, values), name
    bf16 = plan.published("klein-9b-kv", "bfloat16")
    q4 = plan.in_format(bf16, "Q4_0", "Q4_0")
    full, quantized = (planning.plan("klein-9b-kv", size=(64, 64), models=m) for m in (bf16, q4))
    # The quantized Linears at 18 / 32 bytes where bf16 takes 2: the embedders and final layer stay bf16.
    abstract, text = plan.abstract_models(bf16.transformer, bf16.text_encoder)[:2]
    kept = sum(
        math.prod(shape)
        for path, shape in stored.linears(abstract).items()
        if path[0] in stored.TRANSFORMER_KEPT
    )
    expected = (full.transformer - 2 * kept) * Fraction(9, 32) + 2 * kept
    assert quantized.transformer == pytest.approx(float(expected), rel=1e-3)
    # The text encoder's Linears and its embedding too (the norms, 0.01%, are in the margin).
    assert quantized.text_encoder == pytest.approx(float(full.text_encoder * Fraction(9, 32)), rel=1e-3)
    assert quantized.policies["sequential"] < full.policies["sequential"] * 0.5


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantized")
    paths = dict(
        q4_0=folder / "t-Q4_0.gguf",
        q4_k=folder / "t-Q4_K.gguf",
        nvfp4=folder / "t-nvfp4.safetensors",
        qwen3=folder / "qwen3-Q4_K.gguf",
    )
    files.write_gguf_transformer(paths["q4_0"], TINY, files.T.Q4_0)
    files.write_gguf_transformer(paths["q4_k"], TINY, files.T.Q4_K)
    files.write_nvfp4_transformer(paths["nvfp4"], TINY)
    files.write_gguf_qwen3(paths["qwen3"], TINY_TEXT, files.T.Q4_K)
    return paths


def test_gguf_transformer_is_comfyui_ggufs_layout(written):
    reader = gguf.GGUFReader(written["q4_k"])
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["double_blocks.0.img_attn.qkv.weight"] == "Q4_K"
    assert kinds["single_blocks.1.linear1.weight"] == "Q4_K"
    assert kinds["single_stream_modulation.lin.weight"] == "Q4_K"
    assert kinds["img_in.weight"] == kinds["final_layer.linear.weight"] == "BF16"
    assert kinds["double_blocks.0.img_attn.norm.query_norm.scale"] == "F32"
    assert file_config(written["q4_k"]) == TINY  # every shape as published, in BFL names
    source = GGUFSource(written["q4_0"])
    qkv = source.get("double_blocks.0.img_attn.qkv.weight")
    assert (
        qkv.shape == (3 * TINY.hidden, TINY.hidden) and np.isfinite(qkv).all() and 0 < np.abs(qkv).max() < 1
    )


def test_nvfp4_transformer_is_bfls_layout(written):
    source = TensorSource.from_file(written["nvfp4"])
    layers = json.loads(source.metadata()["_quantization_metadata"])["layers"]
    assert layers["double_blocks.0.img_attn.qkv"] == {"format": "nvfp4"} and "img_in" not in layers
    d = TINY.hidden
    assert source.dtype("double_blocks.0.img_attn.qkv.weight") == "U8"
    assert source.shape("double_blocks.0.img_attn.qkv.weight") == (3 * d, d // 2)
    assert source.dtype("double_blocks.0.img_attn.qkv.weight_scale") == "F8_E4M3"
    assert source.shape("double_blocks.0.img_attn.qkv.weight_scale") == (3 * d, d // 16)
    assert source.shape("double_blocks.0.img_attn.qkv.weight_scale_2") == ()
    assert source.dtype("img_in.weight") == "BF16"
    scales = source.get("double_blocks.0.img_attn.qkv.weight_scale").astype(np.float32)
    assert np.isfinite(scales).all() and (scales > 0).all()


def test_qwen3_gguf_has_llama_cpp_names_and_a_tokenizer(written):
    reader = gguf.GGUFReader(written["qwen3"])
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["token_embd.weight"] == kinds["blk.27.ffn_down.weight"] == "Q4_K"
    assert kinds["blk.0.attn_norm.weight"] == "F32" and "output.weight" in kinds
    fields = reader.fields
    assert int(fields["qwen3.block_count"].parts[-1][0]) == 28
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == TINY_TEXT.vocab_size
    assert bytes(tokens.parts[tokens.data[ord("a")]]).decode() == "a"
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    # At Qwen3's size: its added tokens at their ids, unused ids past them, every merge's token in the list.
    tokens, types, merges = files.vocabulary(151936)
    assert (tokens[151644], types[151644]) == ("<|im_start|>", gguf.TokenType.CONTROL)
    assert (tokens[151667], types[151667]) == ("<think>", gguf.TokenType.USER_DEFINED)
    assert types[151669] == types[-1] == gguf.TokenType.UNUSED and types[151642] == gguf.TokenType.NORMAL
    assert len(set(tokens)) == len(tokens) and {m.replace(" ", "") for m in merges} <= set(tokens)


def test_a_files_header_plans_as_its_format(written):
    """Planned from the written files' headers, the quantized Linears take what the format's table says
    (NVFP4: and its per-tensor scale, and the padding of its block scales)."""
    base = models()
    by_format = {
        "q4_0": plan.in_format(base, "Q4_0"),
        "q4_k": plan.in_format(base, "Q4_K"),
        "nvfp4": plan.in_format(base, "NVFP4"),
    }
    for name, expected in by_format.items():
        from_file = plan.with_files(base, transformer=written[name])
        assert set(from_file.quantized["transformer"]) == set(expected.quantized["transformer"])
        for path, rate in expected.quantized["transformer"].items():
            assert from_file.quantized["transformer"][path] == pytest.approx(rate, rel=0.02), (name, path)
    text = plan.with_files(base, text_encoder=written["qwen3"]).quantized["text_encoder"]
    assert text == plan.in_format(base, text_encoder="Q4_K").quantized["text_encoder"]
    # Its embedding is kept as its blocks; a stack of two types (llama.cpp's Q4_K_M mixes in Q6_K) too, each
    # layer at Q6_K's row width (210 bytes per 256 values) and a byte naming its type.
    assert text[EMBEDDING] == Fraction(layer_bytes("Q4_K", 1, 256), 256) and len(text) == 8
    tensors = files.qwen3_types(TINY_TEXT, files.T.Q4_K)
    tensors["blk.3.ffn_down.weight"] = (tensors["blk.3.ffn_down.weight"][0], files.T.Q6_K)
    files.write_gguf(written["qwen3"].with_name("mixed-stack.gguf"), "qwen3", tensors, lambda writer: None)
    mixed = plan.with_files(base, text_encoder=written["qwen3"].with_name("mixed-stack.gguf"))
    down = ("model", "layers", "mlp", "down_proj")
    columns = TINY_TEXT.intermediate_size
    assert mixed.quantized["text_encoder"] == text | {down: Fraction(columns // 256 * 210 + 1, columns)}
    other = models(text=Qwen3Config.qwen3_4b())
    with pytest.raises(Exception, match="token embedding is 512 x 256"):
        plan.with_files(other, text_encoder=written["qwen3"])


def test_the_planner_counts_the_blocks_the_loader_keeps(written):
    """A stack with one layer stored as floats is widened at load (`klein.io.block_forms`): the planner
    counts it in the dtype too, not at its other layers' blocks; it counts as blocks what the loader keeps so."""
    tensors = files.transformer_types(TINY, files.T.Q4_0)
    tensors["single_blocks.1.linear1.weight"] = (tensors["single_blocks.1.linear1.weight"][0], files.T.BF16)
    path = written["q4_0"].with_name("one-layer-bf16.gguf")
    files.write_gguf(path, "flux", tensors, lambda writer: None)
    planned = plan.with_files(models(), transformer=path).quantized["transformer"]
    loaded = load_transformer_file(path)
    kept = {module for module, linear in nnx.iter_modules(loaded) if getattr(linear, "blocks", None)}
    assert set(planned) == kept
    assert ("single_transformer_blocks", "attn", "to_qkv_mlp_proj") not in planned
    assert (
        len(planned)
        == len(plan.with_files(models(), transformer=written["q4_0"]).quantized["transformer"]) - 1
    )


def test_named_cards_know_their_memory_and_8_bit_products():
    assert devices.DEVICES["rtx-4060"].limit == 7 * 2**30 and devices.DEVICES["rtx-4060"].compute == "fp8"
    assert devices.DEVICES["rtx-3060"].limit == 11 * 2**30 and devices.DEVICES["rtx-3060"].compute == "int8"
    assert devices.DEVICES["rtx-3080"].memory_gib == 10 and devices.DEVICES["rtx-4070"].memory_gib == 12
    assert "8 GB: rtx-3060-ti (int8)" in devices.listing()


def test_klein_plan_on_an_8_gb_card(klein_home, tmp_path, monkeypatch, capsys):
    """The quantized klein-9b-kv (Q4 transformer and text encoder) on an RTX 4060: FP8 products there, and
    `auto` takes the fastest policy that fits in 7 GiB."""
    args = ["plan", "--model", "klein-9b-kv", "--size", "1024x1024", "--device", "rtx-4060", "--json"]
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 0  # in this process, as `klein plan` runs it
    report = json.loads(capsys.readouterr().out)
    assert report["compute"] == "fp8" and report["device_memory"]["bytes"] == 7 * 2**30
    assert report["auto"] == "stream"
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert "rtx-4060 (fp8)" in help_text and "rtx-3060 (int8)" in help_text


def test_auto_on_a_12_gb_card_follows_the_stored_form():
    q4 = plan.in_format(plan.published("klein-9b-kv", "bfloat16"), "Q4_0", "Q4_K")
    planned = planning.plan("klein-9b-kv", refs=1, size=(1024, 1024), models=q4)
    fitting = [name for name, peak in planned.policies.items() if peak <= devices.DEVICES["rtx-3060"].limit]
    assert fitting[0] == "sequential"
    bf16 = planning.plan("klein-9b-kv", refs=1, size=(1024, 1024))
    assert [n for n, p in bf16.policies.items() if p <= devices.DEVICES["rtx-3060"].limit] == ["stream"]


def test_plan_refuses_a_missing_or_wrong_file(written, capsys):
    assert cli.main(["plan", "--transformer", "missing.gguf"]) == 2
    assert "--transformer missing.gguf: no such file" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "klein-4b", "--text-encoder", str(written["qwen3"])]) == 2
    assert "a text encoder of another size (klein-4b takes Qwen3-4B" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "klein-4b", "--text-encoder", str(written["q4_0"])]) == 2
    assert "not a Qwen3 text encoder" in capsys.readouterr().err


def test_admission_counts_gguf_files_as_klein_plan_does(klein_home, tmp_path, monkeypatch):
    """The pipeline's weight figures (what admission and `auto` judge by) for a GGUF transformer and a GGUF
    text encoder are the planner's for those files (`klein plan --transformer --text-encoder`): their
    blocks at the files' bytes, not widened to the dtype."""
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    cfg = TransformerConfig.from_diffusers(demo.TRANSFORMER)
    path, text_path = tmp_path / "demo-Q8_0.gguf", tmp_path / "qwen3-demo-Q8_0.gguf"
    files.write_gguf_transformer(path, cfg, files.T.Q8_0)
    pipe = load_pipeline("demo", transformer=path)
    files.write_gguf_qwen3(text_path, pipe.text_config, files.T.Q8_0)
    pipe = load_pipeline("demo", transformer=path, text_encoder=text_path)
    described = plan.Models(pipe.config, pipe.text_config, pipe.vae_config, pipe.variant)
    sizes = (pipe.config, pipe.text_config, pipe.vae_config, SINGLE, 2)
    expected = plan.model_bytes(*sizes, quantized=plan.with_files(described, path, text_path).quantized)
    widened = plan.model_bytes(*sizes)
    for part in ("transformer", "text_encoder"):
        assert pipe.weight_bytes[part] == expected[part], part
        assert expected[part] < 0.7 * widened[part], part
