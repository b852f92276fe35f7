"""Weights kept in a file's quantisation blocks (GGUF's ggml types, NVFP4) and widened inside each product:
each format's widened values equal their definition (`gguf.quants.dequantize` for GGUF, bit for bit; a
NumPy reading of the NVFP4 layout written here from the format's description); a GGUF transformer kept
as blocks gives the images of the same file dequantised at load under every residency policy and with a
merged LoRA, its weights stored as the file's bytes; an NVFP4 file the outputs of its dequantised weights."""

import json

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from klein.io import block_forms
from klein.io.mapped import Whole
from klein.io.transformer_checkpoint import abstract_transformer
from klein.io.transformer_file import file_config, kept_forms, load_transformer_file
from klein.memory import stored as stored_bytes
from klein.models import gguf_blocks, nvfp4, products
from klein.models import transformer as T
from klein.pipeline.loading import load_pipeline
from tests.support import lora_files
from tests.support.bfl_files import to_bfl, write_gguf, write_safetensors
from tests.support.transformer_inputs import jx, make_case, ropes

Q = gguf.GGMLQuantizationType
LATENTS = np.random.default_rng(0).standard_normal((1, 128, 3, 4)).astype(np.float32)
RUN = dict(height=48, width=64, num_inference_steps=2, latents=LATENTS, output_type="np")
TOL = 1e-5  # float32 compute: the same weights, products in another order
# Where the float16 scales of each type's block lie (byte offsets), set to finite values in random blocks.
F16_AT = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def random_blocks(ggml_type: str, rows: int, blocks: int, rng) -> np.ndarray:
    values, size = gguf_blocks.sizes(ggml_type)
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in F16_AT[ggml_type]:
        raw[..., at : at + 2] = (
            rng.uniform(-2, 2, (rows, blocks)).astype(np.float16)[..., None].view(np.uint8)
        )
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("ggml_type", gguf_blocks.TYPES)
def test_gguf_blocks_widen_to_ggufs_values_bit_for_bit(ggml_type):
    raw = random_blocks(ggml_type, 6, 3, np.random.default_rng(1))
    want = gguf.quants.dequantize(raw, Q[ggml_type])
    # As a stack's layer arrives: its bytes viewed as float8 (`klein.models.stacks`).
    floats = raw.view(ml_dtypes.float8_e4m3fn)
    got = np.asarray(jax.jit(products.unpacked, static_argnums=1)(floats, ggml_type))
    assert got.dtype == np.float32 and np.isfinite(want).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


class _Layers(dict):
    """Tensors by name, read as a GGUF file's blocks are (`klein.io.mapped` pieces read them)."""

    def shape(self, key):
        return self[key].shape

    def get(self, key):
        return self[key]


@pytest.mark.parametrize(
    "per_layer", [("Q6_K", "Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q8_0", "Q6_K", "Q4_K")], ids=["two", "three"]
)
def test_a_mixed_stack_keeps_its_blocks_and_widens_each_layer_by_its_type(per_layer):
    """A stack mixing ggml types (as llama.cpp's Q4_K_M files mix Q6_K among Q4_K) is kept as blocks, every
    row padded to the widest type's and tagged with its layer's type: uint8[L, out, widest + 1]. Each
    layer, sliced inside a scan as the layer loop slices it (its bytes as float8), widens to gguf's values
    of that layer bit for bit, and so does the whole stack at once (a LoRA merge's restore), in float32
    and in bf16."""
    rng = np.random.default_rng(2)
    layers = _Layers(
        {
            str(i): random_blocks(kind, 6, 512 // gguf_blocks.sizes(kind)[0], rng)
            for i, kind in enumerate(per_layer)
        }
    )
    blocks = block_forms.stack_blocks(per_layer)
    assert blocks == tuple(kind for kind in gguf_blocks.TYPES if kind in per_layer)
    pieces = [block_forms.layer_piece(Whole(str(i)), blocks, kind) for i, kind in enumerate(per_layer)]
    stack = np.stack([piece.read(layers) for piece in pieces])
    widest = max(layers[str(i)].shape[1] for i in range(len(per_layer)))
    assert stack.dtype == np.uint8 and stack.shape == (len(per_layer), 6, widest + 1)
    assert products.packed_width(blocks, 512) == widest + 1 == pieces[0].shape(layers)[-1]
    want = np.stack([gguf.quants.dequantize(layers[str(i)], Q[kind]) for i, kind in enumerate(per_layer)])

    def widen(_, layer):
        return None, products.unpacked(layer, blocks)

    _, scanned = jax.jit(lambda s: jax.lax.scan(widen, None, s))(stack.view(ml_dtypes.float8_e4m3fn))
    whole = jax.jit(products.unpacked, static_argnums=1)(stack, blocks)
    for got in (np.asarray(scanned), np.asarray(whole)):
        assert got.dtype == np.float32 and np.isfinite(want).all()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # Rounded to bf16 inside the switch's branches, as a bf16 product asks: the widened values' bf16.
    rounded = np.asarray(jax.jit(products.unpacked, static_argnums=(1, 2))(stack, blocks, jnp.bfloat16))
    np.testing.assert_array_equal(rounded.view(np.uint16), want.astype(jnp.bfloat16).view(np.uint16))


def nvfp4_reference(packed, swizzled, rows, columns):
    """NVFP4 as described: E2M1 codes (sign bit 3, exponent bits 2-1, mantissa bit 0; exponent 0 is
    subnormal, 0.5 per mantissa step), the first value of a byte in its high nibble; one E4M3 scale per
    16 values of a row, scale (r, b) at byte ((r // 128) * tiles_across + b // 4) * 512 + (r % 32) * 16 +
    (r % 128 // 32) * 4 + b % 4 of the swizzled tiles."""
    out = np.zeros((rows, columns), np.float32)
    tiles_across = -(-columns // 16 // 4)
    flat = swizzled.reshape(-1)
    for r in range(rows):
        for c in range(columns):
            byte = int(packed[r, c // 2])
            code = byte >> 4 if c % 2 == 0 else byte & 0xF
            sign, exponent, mantissa = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
            value = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
            b = c // 16
            at = ((r // 128) * tiles_across + b // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + b % 4
            out[r, c] = np.float32(sign * value) * np.float32(flat[at])
    return out


def random_nvfp4(rows: int, columns: int, rng):
    """(packed uint8[rows, columns / 2], swizzled E4M3 scales) with every value and scale random."""
    packed = rng.integers(0, 256, (rows, columns // 2), dtype=np.uint8)
    size = nvfp4.swizzled_size(rows, columns)
    scales = rng.uniform(2**-6, 4, size).astype(ml_dtypes.float8_e4m3fn)
    return packed, scales.reshape(-(-rows // 128) * 128, -1)


def test_nvfp4_blocks_widen_to_the_formats_values():
    """Rows past one tile (128) and blocks past one tile column (4) so that the swizzle's tile order
    shows; the values exact in float32 (a 4-bit times an 8-bit float)."""
    rows, columns = 136, 96
    packed, scales = random_nvfp4(rows, columns, np.random.default_rng(2))
    blocks = nvfp4.as_blocks(packed, scales)
    assert blocks.dtype == np.uint8 and blocks.shape == (rows, columns // 16 * 9)
    want = nvfp4_reference(packed, scales, rows, columns)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(products.unpacked, static_argnums=1)(blocks, "nvfp4")), want
    )
    np.testing.assert_array_equal(nvfp4.dequantise(blocks), want)  # NumPy, as at load


# ---- a GGUF transformer kept as blocks, through the pipeline ----

# Linears (BFL module names without the block index) -> ggml type; any other 2-D weight is Q8_0.
KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def gguf_types(bfl: dict) -> dict:
    """A type per Linear, the same in every layer of its stack, cycling through `KINDS`; the single blocks'
    linear2 Q4_0 in one layer and Q8_0 in the other (a stack of two types, as Q4_K_M files have)."""
    modules = sorted(
        {".".join(p for p in k.split(".")[:-1] if not p.isdigit()) for k, v in bfl.items() if v.ndim == 2}
    )
    kind = {module: Q[KINDS[i % len(KINDS)]] for i, module in enumerate(modules)}
    types = {}
    for key, value in bfl.items():
        if value.ndim == 2:
            types[key] = kind[".".join(p for p in key.split(".")[:-1] if not p.isdigit())]
    types["single_blocks.0.linear2.weight"], types["single_blocks.1.linear2.weight"] = Q.Q4_0, Q.Q8_0
    return types


@pytest.fixture(scope="module")
def gguf_parts(tiny_pipelines, tmp_path_factory):
    folder, reference = tiny_pipelines("distilled")
    bfl = {k: v.numpy() for k, v in to_bfl(reference.transformer.state_dict()).items()}
    types = gguf_types(bfl)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "flux-2-klein-tiny-mixed.gguf", bfl, types)
    return dict(transformer=path, text_encoder=folder, vae=folder / "vae", dtype="float32"), types


@pytest.fixture(scope="module")
def widened(gguf_parts):
    """The same file dequantised at load, and its image."""
    pipe = load_pipeline(**gguf_parts[0], dequantize=True, residency="all")
    return pipe, pipe("a red fox", **RUN).images


@pytest.fixture(scope="module")
def kept(gguf_parts):
    return load_pipeline(**gguf_parts[0], residency="all")


def stored(pipe) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(pipe._models["transformer"].get()[1])}


def test_gguf_weights_are_the_files_bytes(gguf_parts, kept):
    """Every Linear whose stack has one type holds the file's blocks, uint8 [L?, out, bytes]: as many
    bytes as the file has for it; the stack of two types holds each layer's rows padded to Q8_0's width
    and tagged with a byte naming the layer's type."""
    parts, types = gguf_parts
    reader = {t.name: t for t in gguf.GGUFReader(parts["transformer"]).tensors}
    weights = stored(kept)
    qkv = weights[("transformer_blocks", "attn", "to_q", "weight")]
    assert qkv.dtype == np.uint8
    # The fused img_attn.qkv of block 1, its first third of rows: to_q's layer 1, byte for byte.
    rows = reader["double_blocks.1.img_attn.qkv.weight"].data
    np.testing.assert_array_equal(qkv[1], rows[: len(rows) // 3])
    packed = {p: v for p, v in weights.items() if p[-1] == "weight" and v.dtype == np.uint8}
    kept = sum(v.nbytes for v in packed.values())
    in_file = sum(t.data.nbytes for name, t in reader.items() if types.get(name) and "linear2" not in name)
    mixed = weights[("single_transformer_blocks", "attn", "to_out", "weight")]
    q4, q8 = (reader[f"single_blocks.{i}.linear2.weight"].data for i in (0, 1))
    assert mixed.dtype == np.uint8 and mixed.shape == (2, len(q8), q8.shape[1] + 1)
    np.testing.assert_array_equal(mixed[0, :, : q4.shape[1]], q4)
    np.testing.assert_array_equal(mixed[1, :, :-1], q8)
    assert not mixed[0, :, q4.shape[1] : -1].any()
    tags = [set(mixed[i, :, -1].tolist()) for i in (0, 1)]
    assert sorted(tags, key=min) == [{0}, {1}]
    assert kept == in_file + mixed.nbytes
    # The planner counts the padded rows.
    abstract = abstract_transformer(file_config(parts["transformer"]))
    rate = stored_bytes.rates(abstract, kept_forms(parts["transformer"]))[
        ("single_transformer_blocks", "attn", "to_out")
    ]
    assert rate * len(q8) * products.unpacked_width("Q8_0", q8.shape[1]) == mixed[0].nbytes
    assert ("single_transformer_blocks", "attn", "to_out", "kernel") not in weights


@pytest.mark.parametrize("residency", ["all", "sequential", "stream"])
def test_gguf_kept_as_blocks_gives_the_dequantised_image(gguf_parts, kept, widened, residency):
    pipe = kept if residency == "all" else load_pipeline(**gguf_parts[0], residency=residency)
    image = pipe("a red fox", **RUN).images
    assert np.abs(image - widened[1]).max() <= TOL


def test_gguf_blocks_with_a_lora_merged(gguf_parts, widened, tmp_path):
    """A LoRA merged into blocks widens those stacks (to the dequantised values plus the update): the
    image of the dequantised file with the same LoRA; none restores the file's bytes, bit for bit. Under
    `stream`, whose stacks are merged in host memory a layer at a time through the device (`all` merges
    on the device by the same `_merged`)."""
    pipe = load_pipeline(**gguf_parts[0], residency="stream")
    before = stored(pipe)
    shapes = lora_files.linear_shapes(pipe.config, "bfl")
    targets = ("double_blocks.1.img_attn.qkv", "single_blocks.0.linear1", "single_blocks.1.linear2", "img_in")
    lora = lora_files.random_lora({m: shapes[m] for m in targets}, 4, 5)
    spec = [(lora_files.write_bfl(tmp_path / "lora.safetensors", lora), 0.8)]
    pipe.set_loras(spec)
    reference, plain = widened
    reference.set_loras(spec)
    try:
        want = reference("a red fox", **RUN).images
    finally:
        reference.set_loras([])
    image = pipe("a red fox", **RUN).images
    assert np.abs(image - want).max() <= TOL
    assert np.abs(image - plain).max() > 100 * TOL  # the LoRA shows
    pipe.set_loras([])
    after = stored(pipe)
    for path, value in before.items():
        assert after[path].dtype == value.dtype
        np.testing.assert_array_equal(after[path], value, err_msg=str(path))


# ---- NVFP4 files ----


def nvfp4_file(model, path):
    """The tiny transformer's BFL tensors with every block Linear replaced by random NVFP4 (ComfyUI's
    layout, per-tensor scale 0.01), and the rest as they are."""
    rng = np.random.default_rng(3)
    tensors, layers = {}, {}
    for key, tensor in to_bfl(model.state_dict()).items():
        if key.startswith(("double_blocks.", "single_blocks.")) and tensor.ndim == 2:
            layer = key.removesuffix(".weight")
            packed, scales = random_nvfp4(*tensor.shape, rng)
            tensors[key] = torch.from_numpy(packed)
            tensors[f"{layer}.weight_scale"] = torch.from_numpy(scales.view(np.uint8)).view(
                torch.float8_e4m3fn
            )
            tensors[f"{layer}.weight_scale_2"] = torch.tensor(0.01, dtype=torch.float32)
            layers[layer] = {"format": "nvfp4"}
        else:
            tensors[key] = tensor
    header = json.dumps({"format_version": "1.0", "layers": layers})
    return write_safetensors(path, tensors, {"_quantization_metadata": header})


def test_nvfp4_kept_4_bit_equals_its_dequantised_weights(tiny_transformer, tmp_path):
    path = nvfp4_file(tiny_transformer[1], tmp_path / "flux-2-klein-tiny-nvfp4.safetensors")
    kept = load_transformer_file(path)
    widened = load_transformer_file(path, dequantize=True)
    weight = kept.single_transformer_blocks.attn.to_qkv_mlp_proj.weight[...]
    kernel = widened.single_transformer_blocks.attn.to_qkv_mlp_proj.kernel[...]
    assert weight.dtype == np.uint8 and weight.shape[-1] * 16 == kernel.shape[-2] * 9  # 4.5 bits a value
    assert kept.single_transformer_blocks.attn.to_qkv_mlp_proj.weight_scale[...].tolist() == [
        np.float32(0.01)
    ] * len(weight)
    got, want = velocity(kept), velocity(widened)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()
    assert np.abs(want).max() > 0.1


def velocity(model) -> np.ndarray:
    case = make_case(0, 2, width=96)
    img_rope, txt_rope = ropes(model, case.img_ids, case.txt_ids)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, *args: T.forward(nnx.merge(graphdef, state), *args))
    return np.asarray(run(state, *jx(case.img, case.txt, case.t), img_rope, txt_rope), np.float32)
