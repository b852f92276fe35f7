"""Bytes per weight of the Linears a quantized file keeps as its blocks (GGUF, NVFP4), for the planner
(`klein.memory.plan`): which Linears, in which form, as io describes a file from its header for its loader
(`klein.io.transformer_file.kept_forms`, `klein.io.text_encoder_gguf.kept_forms`), or as the usual
downloads in a format hold them (`uniform`), for the files planned before anyone has them (the README's
memory table); their bytes as memory holds them (`klein.io.block_forms.layer_bytes`).

A weight stored in a form the abstract model already builds (bf16, FP8 with its scale, 8-bit kernels for
8-bit products) is counted from the model's own Params. A stored map goes module path (as in the model's
state, stacks without their layer index) -> bytes per weight; the module's kernel (or weight) is counted at
that rate and its scales with it.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from flax import nnx

from klein.errors import CheckpointError, InputError
from klein.io import text_encoder_gguf
from klein.io import transformer_file as transformer_reader
from klein.io.block_forms import layer_bytes
from klein.models import products

FORMATS = {name.upper(): name for name in products.BLOCKS}
"""The block formats a file may keep (`klein.models.products.BLOCKS`), by the names people know them by."""

# ComfyUI-GGUF leaves the embedders and the final layer of a FLUX model unquantized (BFL's img_in, txt_in,
# time_in, final_layer); their weights are widened to the compute dtype as the rest of the model is.
TRANSFORMER_KEPT = ("x_embedder", "context_embedder", "time_guidance_embed", "norm_out", "proj_out")


def linears(abstract: nnx.Module) -> dict[tuple, tuple[int, ...]]:
    """Module path -> kernel shape (stacked: with the layer axis) of every Linear of an abstract model,
    and the embedding's table."""
    return {path: shape for path, (_, shape) in _weights(abstract).items()}


def _weights(abstract: nnx.Module) -> dict[tuple, tuple[str, tuple[int, ...]]]:
    found = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        if path[-1] in ("kernel", "weight", "embedding"):
            found[tuple(path[:-1])] = path[-1], variable.get_value().shape
    return found


def uniform(abstract: nnx.Module, fmt: str, kept: tuple[str, ...] = ()) -> dict[tuple, Fraction]:
    """Every Linear (and embedding) of `abstract` stored as `fmt` (one of `FORMATS`) but those under `kept`,
    as the usual downloads in that format are made."""
    if fmt.upper() not in FORMATS:
        raise InputError(f"unknown stored format {fmt!r}; known: {', '.join(FORMATS)}")
    return rates(abstract, {path: FORMATS[fmt.upper()] for path in linears(abstract) if path[0] not in kept})


def rates(abstract: nnx.Module, forms: dict[tuple, str | tuple[str, ...]]) -> dict[tuple, Fraction]:
    """Bytes per weight of the modules of `abstract` kept as `forms` says (module path -> `blocks`)."""
    weights = _weights(abstract)
    found = {}
    for path, blocks in forms.items():
        leaf, shape = weights[path]
        # A kernel [in, out] holds a row of blocks per output; an embedding [vocab, width] one per token.
        rows, columns = shape[-2:] if leaf == "embedding" else shape[:-3:-1]
        found[path] = Fraction(layer_bytes(blocks, rows, columns), rows * columns)
    return found


def transformer_file(path: Path, abstract: nnx.Module) -> dict[tuple, Fraction]:
    """Bytes per weight of the transformer's Linears that `path` (a GGUF or NVFP4 single file in BFL
    names) keeps as blocks, as its loader keeps them; those stored as floats are counted by the model."""
    return rates(abstract, _read(transformer_reader.kept_forms, path))


def text_encoder_file(path: Path, abstract: nnx.Module, layers: int) -> dict[tuple, Fraction]:
    """Bytes per weight of the Linears of the first `layers` decoder layers (those the prompt embedding
    runs) and of the token embedding that a Qwen3 GGUF in llama.cpp's names keeps as blocks, as its
    loader keeps them; the rest the model counts in the dtype, as it is widened at load."""
    if path.suffix.lower() != ".gguf":
        return {}
    return rates(abstract, _read(text_encoder_gguf.kept_forms, path, abstract.config, (layers,)))


def _read(describe, path: Path, *args):
    """io's description of the file the user named (`describe(path, *args)`): its problems are theirs."""
    try:
        return describe(path, *args)
    except CheckpointError as exc:
        raise InputError(str(exc)) from None
