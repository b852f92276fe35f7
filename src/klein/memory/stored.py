"""Bytes per weight of the Linears a quantized file keeps quantized (GGUF blocks, NVFP4), for the planner
(`klein.memory.plan`): read from a file's header (never its data), or named by format for the downloads
planned before anyone has them (the README's memory table).

A weight stored in a form the abstract model already builds (bf16, FP8 with its scale, 8-bit kernels for
8-bit products) is counted from the model's own Params; the files here store their Linears as blocks of
bytes whose layout the planner only needs the size of: `FORMATS`, bytes per weight, scales included.
A stored map goes module path (as in the model's state, stacks without their layer index) -> bytes per
weight; the module's kernel (or weight) is counted at that rate and its scales with it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

from flax import nnx

from klein.errors import CheckpointError, InputError
from klein.io import bfl_transformer_keys as bfl
from klein.io.block_forms import kept_blocks, stack_blocks
from klein.io.gguf_header import read_header
from klein.io.safetensors import TensorSource
from klein.io.transformer_checkpoint import key_map
from klein.models import gguf_blocks, products

FORMATS = {
    # GGUF (ggml) blocks: bytes per block / weights per block; each block carries its fp16 scale(s).
    "Q8_0": Fraction(34, 32),
    "Q6_K": Fraction(210, 256),
    "Q5_K": Fraction(176, 256),
    "Q5_1": Fraction(24, 32),
    "Q5_0": Fraction(22, 32),
    "Q4_K": Fraction(144, 256),
    "Q4_1": Fraction(20, 32),
    "Q4_0": Fraction(18, 32),
    "Q3_K": Fraction(110, 256),
    "Q2_K": Fraction(84, 256),
    # FP4 E2M1 values two to a byte, an FP8 E4M3 scale per 16 (and a float32 scale per tensor, `PER_TENSOR`).
    "NVFP4": Fraction(9, 16),
}
PER_TENSOR = {"NVFP4": 4}
"""Bytes a format adds once per tensor."""

# ComfyUI-GGUF leaves the embedders and the final layer of a FLUX model unquantized (BFL's img_in, txt_in,
# time_in, final_layer); their weights are widened to the compute dtype as the rest of the model is.
TRANSFORMER_KEPT = ("x_embedder", "context_embedder", "time_guidance_embed", "norm_out", "proj_out")

# llama.cpp's tensor names in a Qwen3 GGUF -> the text encoder's modules (`klein.models.qwen3`).
QWEN3_GGUF = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
EMBEDDING = ("model", "embed_tokens")


def linears(abstract: nnx.Module) -> dict[tuple, tuple[int, ...]]:
    """Module path -> kernel shape (stacked: with the layer axis) of every Linear of an abstract model,
    and the embedding's table."""
    found = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        if path[-1] in ("kernel", "weight", "embedding"):
            found[tuple(path[:-1])] = variable.get_value().shape
    return found


def uniform(abstract: nnx.Module, fmt: str, kept: tuple[str, ...] = ()) -> dict[tuple, Fraction]:
    """Every Linear (and embedding) of `abstract` stored as `fmt` but those under `kept`, as the usual
    downloads in that format are made."""
    if fmt not in FORMATS:
        raise InputError(f"unknown stored format {fmt!r}; known: {', '.join(FORMATS)}")
    rate = FORMATS[fmt]
    return {
        path: rate + Fraction(PER_TENSOR.get(fmt, 0), _per_layer(shape))
        for path, shape in linears(abstract).items()
        if path[0] not in kept
    }


def _per_layer(shape: tuple[int, ...]) -> int:
    return shape[-1] * shape[-2]


def transformer_file(path: Path, abstract: nnx.Module) -> dict[tuple, Fraction]:
    """Bytes per weight of the transformer's Linears that `path` (a GGUF or NVFP4 single file in BFL
    names) keeps quantized, from its header; those stored as floats are counted by the model."""
    sizes, prefix = _file_sizes(path)
    formats = _gguf_formats(path)
    stored: dict[tuple, list[int]] = {}
    kinds: dict[tuple, list[str | None]] = {}
    shapes = linears(abstract)
    for module, shape in shapes.items():
        layers = shape[0] if len(shape) == 3 else None
        for index in range(layers or 1):
            names = [module[0], *([str(index)] if layers else []), *module[1:], "weight"]
            source = bfl.bfl_key(key_map(".".join(names)))
            layer = prefix + source.key.removesuffix(".weight")
            size = sizes.get(layer)
            if size is not None:
                total = stored.setdefault(module, [0, 0])
                total[0] += Fraction(size, source.blocks)
                total[1] += _per_layer(shape)
                kinds.setdefault(module, []).append(formats.get(layer))
    rates = {module: Fraction(bytes_) / count for module, (bytes_, count) in stored.items()}
    mixed = {module: stack_blocks(found) for module, found in kinds.items()}
    rates.update(
        {module: _padded(blocks, shapes[module]) for module, blocks in mixed.items() if _mixed(blocks)}
    )
    return rates


def text_encoder_file(path: Path, abstract: nnx.Module, layers: int) -> dict[tuple, Fraction]:
    """Bytes per weight of the text encoder's Linears that a Qwen3 GGUF in llama.cpp's names keeps quantized
    (of the first `layers` decoder layers: those the prompt embedding runs), by the loader's rule
    (`klein.io.block_forms`: quantised in every layer of a stack; one of mixed types at its padded width),
    and of its token embedding where the file quantizes it (kept as its blocks,
    `klein.models.qwen3.Qwen3Model.keep_blocks`); the rest the model counts in the dtype, as it is widened
    at load."""
    if path.suffix.lower() != ".gguf":
        return {}
    tensors = _gguf_tensors(path)
    shapes = linears(abstract)
    if "token_embd.weight" not in tensors:
        raise InputError(f"{path}: no 'token_embd' tensor: not a Qwen3 text encoder in llama.cpp's naming")
    size, kind, found = tensors["token_embd.weight"]
    needed = shapes[EMBEDDING]
    if found != tuple(needed):
        raise InputError(
            f"{path}: its token embedding is {found[0]} x {found[1]}, where this model's text encoder needs "
            f"{needed[0]} x {needed[1]}: a text encoder of another size (klein-4b takes Qwen3-4B, "
            f"klein-9b Qwen3-8B)"
        )
    names = {
        ("model", "layers", *module, "kernel"): [f"blk.{index}.{name}" for index in range(layers)]
        for name, module in QWEN3_GGUF.items()
    }
    formats = {name.removesuffix(".weight"): kind for name, (_, kind, _) in tensors.items()}
    kept = kept_blocks(names, formats)
    rates = {
        module: Fraction(sum(tensors[f"{name}.weight"][0] for name in names[(*module, "kernel")]))
        / (layers * _per_layer(shapes[module]))
        for module, blocks in kept.items()
    }
    rates.update(
        {module: _padded(blocks, shapes[module]) for module, blocks in kept.items() if _mixed(blocks)}
    )
    if kind in gguf_blocks.TYPES:
        rates[EMBEDDING] = Fraction(size, _per_layer(needed))
    return rates


def _mixed(blocks) -> bool:
    return isinstance(blocks, products.MIXED)


def _padded(blocks: tuple[str, ...], shape: tuple[int, ...]) -> Fraction:
    """Bytes per weight of a stack of mixed ggml types (kernel [L, in, out]): every row at the widest
    type's width and its tag byte (`klein.io.block_forms`)."""
    return Fraction(products.packed_width(blocks, shape[-2]), shape[-2])


def _file_sizes(path: Path) -> tuple[dict[str, int], str]:
    """(bytes each quantized layer of `path` takes, keyed by its name less ".weight", with its side
    tensors; the file's key prefix, ComfyUI's "model.diffusion_model." or none)."""
    if path.suffix.lower() == ".gguf":
        sizes = {name: size for name, (size, kind, _) in _gguf_tensors(path).items() if kind not in _FLOATS}
    else:
        sizes = _nvfp4_sizes(path)
    sizes = {name.removesuffix(".weight"): size for name, size in sizes.items()}
    prefix = "model.diffusion_model." if any(k.startswith("model.diffusion_model.") for k in sizes) else ""
    return sizes, prefix


_FLOATS = ("F32", "F16", "BF16", "F64")


def _gguf_formats(path: Path) -> dict[str, str]:
    """Stored layer (name less ".weight") -> ggml type of a GGUF file's quantized tensors ({} for others)."""
    if path.suffix.lower() != ".gguf":
        return {}
    tensors = _gguf_tensors(path)
    return {
        name.removesuffix(".weight"): kind for name, (_, kind, _) in tensors.items() if kind not in _FLOATS
    }


def _gguf_tensors(path: Path) -> dict[str, tuple[int, str, tuple[int, ...]]]:
    """name -> (bytes, ggml type name, PyTorch shape) of a GGUF file's tensors, from its header."""
    try:
        header = read_header(path)
    except CheckpointError as exc:
        raise InputError(str(exc)) from None
    return {
        name: (header.nbytes(name), kind.name, header.shapes[name]) for name, kind in header.types.items()
    }


_SIDES = (".weight_scale", ".weight_scale_2", ".input_scale")
_BYTES = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "F64": 8}


def _nvfp4_sizes(path: Path) -> dict[str, int]:
    """Bytes of each layer of a safetensors file whose weight is packed into bytes (NVFP4: U8), its scales
    included."""
    source = TensorSource.from_file(path)
    keys = source.keys()

    def size(key: str) -> int:
        return math.prod(source.shape(key)) * _BYTES.get(source.dtype(key), 4)

    layers = [
        key.removesuffix(".weight") for key in keys if key.endswith(".weight") and source.dtype(key) == "U8"
    ]
    return {
        layer: size(f"{layer}.weight") + sum(size(layer + side) for side in _SIDES if layer + side in keys)
        for layer in layers
    }
