"""Weights holding a NaN or an infinity are refused as they are read, the file and tensor named: in every
float type a safetensors file stores, in a GGUF file's float tensors and block scales, in LoRAs and
LyCORIS adapters (their alphas too); on the CLI (`klein generate`: exit 2, no image) for a spoilt LoRA,
transformer, VAE or text encoder of the demo checkpoint, and at the start of `klein serve` for a LoRA it
offers. Before, each gave an all-black image and exit 0 (and the server a black 200 per request)."""

import json
import os
import re
import shutil
import subprocess
import sys

import gguf
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from klein.errors import CheckpointError
from klein.io import demo
from klein.io.finite import all_finite
from klein.io.gguf_file import GGUFSource
from klein.io.safetensors import TensorSource
from klein.lora.loading import read_lora
from klein.models.transformer_config import TransformerConfig
from klein.serve.errors import ApiError
from klein.serve.jobs import JobTable
from klein.serve.metrics import Metrics
from klein.serve.worker import Worker
from tests.support import lora_files as lf
from tests.support import lyco_files
from tests.support.serve_process import free_port
from tests.test_cli import assert_clean_error, run_klein

SHAPES = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
T = gguf.GGMLQuantizationType
NAN_F16, ONE_F16 = (np.array([value], np.float16).view(np.uint8) for value in (np.nan, 1.0))

# Every float type klein reads, with the non-finite values it can hold (FP8 E4M3 "fn": NaN, no infinity).
SPOILERS = {
    np.float64: (np.nan, np.inf, -np.inf),
    np.float32: (np.nan, np.inf, -np.inf),
    np.float16: (np.nan, np.inf, -np.inf),
    ml_dtypes.bfloat16: (np.nan, np.inf, -np.inf),
    ml_dtypes.float8_e5m2: (np.nan, np.inf, -np.inf),
    ml_dtypes.float8_e4m3fn: (np.nan,),
}
CASES = [(dtype, value) for dtype, values in SPOILERS.items() for value in values]


def spoilt(array: np.ndarray, value, at: int) -> np.ndarray:
    out = array.copy()
    out.reshape(-1)[at] = value
    return out


@pytest.mark.parametrize("dtype,value", CASES, ids=[f"{np.dtype(d).name}-{v}" for d, v in CASES])
def test_every_float_type_is_checked(dtype, value):
    """Finite values up to the largest pass; one NaN or infinity anywhere (past the first chunk too) fails."""
    largest = ml_dtypes.finfo(dtype).max
    values = np.random.default_rng(0).standard_normal(3_000_001).astype(dtype)
    values[:2] = largest, -largest
    assert all_finite(values) and all_finite(values[:0])
    for at in (0, 1_234_567, values.size - 1):
        assert not all_finite(spoilt(values, value, at)), at


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_a_safetensors_tensor_is_refused_with_its_file_and_name(tmp_path, dtype):
    weight = torch.ones(4, 8).to(dtype)
    weight[2, 5] = float("nan")
    path = tmp_path / "spoilt.safetensors"
    save_file({"blocks.0.weight": weight, "blocks.0.bias": torch.zeros(4).to(dtype)}, str(path))
    source = TensorSource.from_file(path)
    assert not source.get("blocks.0.bias").any()  # a finite tensor of the same file reads as ever
    with pytest.raises(CheckpointError) as caught:
        source.get("blocks.0.weight")
    message = str(caught.value)
    assert message.startswith(f"{path}: tensor 'blocks.0.weight' holds 1 NaN value (the first at [2, 5])")
    assert "black images" in message
    assert source.get("blocks.0.weight", rows=slice(0, 2)).shape == (2, 8)  # rows without it read


def gguf_blocks(kind: T, rows: int, rng) -> tuple[np.ndarray, tuple[int, ...]]:
    """(random blocks uint8[rows, 4 blocks] of `kind` whose float16 scales are 1, where those scales are):
    the bytes at which `gguf.quants.dequantize` gives NaN for a NaN float16."""
    values, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, 4 * size), np.uint8)
    blocks = raw.reshape(rows, 4, size)
    scales = []
    for at in range(0, size, 2):  # each float16 the dequantised values are NaN for
        probe = blocks[:1, :1].copy()
        probe[..., at : at + 2] = NAN_F16
        if not np.isfinite(gguf.quants.dequantize(probe.reshape(1, -1), kind)).all():
            scales.append(at)
    for at in scales:
        blocks[..., at : at + 2] = ONE_F16
    return raw, tuple(scales)


QUANTISED = [T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K, T.Q3_K, T.Q2_K, T.Q5_1, T.Q5_0, T.Q4_1, T.Q4_0]


@pytest.mark.parametrize("kind", QUANTISED, ids=[kind.name for kind in QUANTISED])
def test_a_gguf_block_scale_is_refused(tmp_path, kind):
    """Each scale of a block (found by gguf's own dequantiser) spoilt in turn: refused whether the tensor is
    widened or kept as its blocks; the same blocks with finite scales read as ever."""
    raw, scales = gguf_blocks(kind, 3, np.random.default_rng(kind))
    assert scales and np.isfinite(gguf.quants.dequantize(raw, kind)).all()
    tensors = {"clean.weight": raw}
    for at in scales:
        bad = raw.copy()
        bad.reshape(3, 4, -1)[1, 2, at : at + 2] = NAN_F16
        tensors[f"scale{at}.weight"] = bad
    path = write_gguf(tmp_path / "spoilt.gguf", tensors, kind)
    source = GGUFSource(path)
    assert source.get("clean.weight").shape == (3, 4 * gguf.GGML_QUANT_SIZES[kind][0])
    for at in scales:
        for read in (source.get, source.blocks.get):
            with pytest.raises(
                CheckpointError, match=rf"^{re.escape(str(path))}: tensor 'scale{at}.weight' has 1"
            ):
                read(f"scale{at}.weight")


@pytest.mark.parametrize("kind", [T.F32, T.F16, T.BF16])
def test_a_gguf_float_tensor_is_refused(tmp_path, kind):
    dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: ml_dtypes.bfloat16}[kind]
    values = spoilt(np.ones((3, 32), dtype), -np.inf, 40)
    stored = values.view(np.uint8) if kind == T.BF16 else values  # gguf's writer takes BF16 as bytes
    path = write_gguf(tmp_path / "spoilt.gguf", {"norm.weight": stored}, kind)
    with pytest.raises(
        CheckpointError, match=r"tensor 'norm.weight' holds 1 infinite value \(the first at \[1, 8"
    ):
        GGUFSource(path).get("norm.weight")


def write_gguf(path, tensors: dict[str, np.ndarray], kind: T):
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "kind,part",
    [("LoKr", "lokr_w1"), ("LoHa", "hada_w2_b"), ("DoRA", "dora_scale"), ("LoKr", "alpha")],
)
def test_an_adapter_is_refused_with_the_tensor_named(tmp_path, kind, part):
    rng = np.random.default_rng(0)
    module = lyco_files.lokr((32, 32), rng, alpha=2.0) if kind == "LoKr" else lyco_files.loha((32, 32), rng)
    if kind == "DoRA":
        module = lyco_files.with_dora(module, torch.ones(32, 32), rng)
    module[part] = spoilt(np.asarray(module[part], np.float32), np.nan, 0)
    path = lyco_files.write(
        tmp_path / "adapter.safetensors", {"double_blocks.0.img_attn.proj": module}, "bfl"
    )
    with pytest.raises(
        CheckpointError, match=rf"tensor 'diffusion_model.double_blocks.0.img_attn.proj.{part}'"
    ):
        read_lora(path)


def test_a_nan_alpha_in_the_peft_config_is_refused(tmp_path):
    lora = lf.random_lora(SHAPES, 4, 0)
    tensors = {
        f"transformer.{m}.lora_{ab}.weight": t
        for m, pair in lora.items()
        for ab, t in zip("AB", pair, strict=True)
    }
    config = json.dumps({"r": 4, "lora_alpha": float("nan")})
    path = lf._save(tmp_path / "peft.safetensors", tensors, {"lora_adapter_metadata": config})
    with pytest.raises(CheckpointError, match=r"lora_alpha is nan.*a finite number"):
        read_lora(path)


# The CLI: a file of the demo checkpoint, or a LoRA, spoilt; `klein generate` refuses it, names the tensor and
# writes no image.


def demo_with(tmp_path, klein_home, part: str, key: str, value):
    """A copy of the demo checkpoint with `value` at one place of tensor `key` of `part`'s weights."""
    folder = shutil.copytree(klein_home / demo.VERSION, tmp_path / "demo")
    path = next((folder / part).glob("*.safetensors"))
    tensors = load_file(path)
    tensors[key] = torch.from_numpy(spoilt(tensors[key].numpy(), value, 5))
    save_file(tensors, str(path))
    return folder, path


def lora_with(tmp_path, key_part: str, value):
    """A BFL-layout LoRA (alpha 4) with `value` in one place of each tensor whose key ends in `key_part`."""
    path = lf.write_bfl(tmp_path / "spoilt.safetensors", lf.random_lora(SHAPES, 4, 0), alpha=4.0)
    tensors = load_file(path)
    for key in tensors:
        if key.endswith(key_part):
            tensors[key] = torch.from_numpy(spoilt(tensors[key].numpy(), value, 0))
    save_file(tensors, str(path))
    return path


FIRST = "diffusion_model.double_blocks.0.img_attn.proj"  # the first module of the LoRA, read first
CLI_CASES = {
    "nan LoRA": lambda tmp, home: (None, lora_with(tmp, "lora_B.weight", np.nan), f"{FIRST}.lora_B.weight"),
    "inf LoRA": lambda tmp, home: (None, lora_with(tmp, "lora_A.weight", -np.inf), f"{FIRST}.lora_A.weight"),
    "nan alpha": lambda tmp, home: (None, lora_with(tmp, ".alpha", np.nan), f"{FIRST}.alpha"),
    "nan transformer": lambda tmp, home: (
        *demo_with(tmp, home, "transformer", "x_embedder.weight", np.nan),
        "x_embedder.weight",
    ),
    "nan VAE": lambda tmp, home: (
        *demo_with(tmp, home, "vae", "decoder.conv_in.weight", np.nan),
        "decoder.conv_in.weight",
    ),
    "inf text encoder": lambda tmp, home: (
        *demo_with(tmp, home, "text_encoder", "model.layers.0.mlp.down_proj.weight", np.inf),
        "model.layers.0.mlp.down_proj.weight",
    ),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_generate_refuses_the_spoilt_file(klein_home, tmp_path, case):
    model, path, key = CLI_CASES[case](tmp_path, klein_home)
    where = ["--model", model] if model else ["--lora", path]
    out = tmp_path / "out.png"
    words = ["generate", *where, "--prompt", "a fox", "--size", "64x64", "--steps", "1", "--out", out]
    assert_clean_error(run_klein(klein_home, *words, cwd=tmp_path), f"{path}: tensor '{key}' holds 1 ")
    assert not out.exists()


def test_serve_refuses_a_spoilt_offered_lora_at_start(klein_home, tmp_path):
    """`klein serve --lora-dir` reads each LoRA it offers at start (as `--lora`, which reads as `klein
    generate --lora` does): a spoilt one is refused before the server answers, so no request meets it."""
    path = lora_with(tmp_path, "lora_B.weight", np.nan)
    command = [sys.executable, "-m", "klein.cli.main", "serve", "--port", str(free_port()), "--no-warm"]
    env = {**os.environ, "KLEIN_HOME": str(klein_home), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [*command, "--lora-dir", tmp_path], env=env, capture_output=True, text=True, timeout=120
    )
    assert_clean_error(result, f"{path}: tensor '{FIRST}.lora_B.weight' holds 1 NaN value")


def test_a_served_model_read_for_a_request_answers_503_without_a_traceback(tmp_path, caplog):
    """Under `--residency sequential` the transformer is read when a request first needs it: a spoilt one
    fails that job with a 503 naming no server path (the log names the file and tensor, without a traceback
    as for a bug), and the worker goes on."""
    path = tmp_path / "spoilt.safetensors"
    save_file({"x_embedder.weight": torch.tensor([[1.0, float("nan")]])}, str(path))
    worker = Worker(8, Metrics(), JobTable(2**30, 60))
    job = worker.submit(lambda job: TensorSource.from_file(path).get("x_embedder.weight"))
    with pytest.raises(ApiError) as raised:
        job.future.result(30)
    assert (raised.value.status, raised.value.code) == (503, "weights_refused")
    assert "log" in raised.value.message and str(tmp_path) not in raised.value.message
    assert f"{path}: tensor 'x_embedder.weight' holds 1 NaN value" in caplog.text
    assert "Traceback" not in caplog.text
    assert worker.submit(lambda job: {"data": []}).future.result(10) == {"data": []}
    worker.stop()
