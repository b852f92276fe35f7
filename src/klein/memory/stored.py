"""Bytes per weight of the Linears a quantized file keeps as its blocks (GGUF, NVFP4), for the planner
(`klein.memory.plan`): of those io reads from a file's header (`rates`), or of those the usual downloads in
a format keep (`uniform`, for files planned before anyone has them). Other weights are counted from the
abstract model's own Params. A map goes module path (stacks without their layer index) -> bytes per weight.
"""

from __future__ import annotations

from fractions import Fraction

from flax import nnx

from klein.errors import InputError
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


def uniform(abstract: nnx.Module, fmt: str, kept: tuple[str, ...] = ()) -> dict[tuple, str]:
    """Every Linear (and embedding) of `abstract` kept as `fmt` (one of `FORMATS`) but those under `kept`,
    as the usual downloads in that format are made: module path -> `blocks`, as io describes a file."""
    if fmt.upper() not in FORMATS:
        raise InputError(f"unknown stored format {fmt!r}; known: {', '.join(FORMATS)}")
    return {path: FORMATS[fmt.upper()] for path in linears(abstract) if path[0] not in kept}


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
