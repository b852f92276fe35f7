"""Loading the FLUX.2 transformer from one file, as downloaded from Black Forest Labs or the community.

The file itself tells its format: BFL safetensors (no config: it is read off the tensor shapes), their FP8
and NVFP4 versions, or GGUF. A Linear of a scanned stack keeps its stored form only if it has that form in
every layer (`klein.io.block_forms`), else it is widened to `dtype` at load.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

from klein.errors import CheckpointError
from klein.io import bfl_transformer_keys as bfl
from klein.io import nvfp4_file
from klein.io.block_forms import gguf_formats, kept_blocks, layer_piece
from klein.io.fp8 import FORMAT as FP8
from klein.io.fp8 import SIDE_TENSORS, quantised_layers
from klein.io.gguf_file import GGUFSource
from klein.io.loading import checkpoint_keys, expected_shapes, load_module
from klein.io.mapped import Dequantized, MappedSource, Scalar, Viewed
from klein.io.quantised import quantised_table
from klein.io.safetensors import TensorSource
from klein.io.transformer_checkpoint import (
    STACKED,
    abstract_transformer,
    key_map,
    quantised_keys,
    stored_forms,
)
from klein.models import products
from klein.models.transformer import Flux2Transformer
from klein.models.transformer_config import TransformerConfig

_PREFIXES = ("", "model.diffusion_model.")  # BFL's files; ComfyUI's saved models
_MARKER = "single_stream_modulation.lin.weight"
_SIDE_TENSORS = {FP8: SIDE_TENSORS, nvfp4_file.FORMAT: nvfp4_file.SIDE_TENSORS}
"""The tensors a quantised layer of each format stores beside its weight."""


def file_config(path: str | Path) -> TransformerConfig:
    """The config of a single-file transformer, from its tensor shapes alone (no weight is read)."""
    return _header(Path(path)).config


def kept_forms(path: str | Path) -> dict[tuple, str | tuple[str, ...]]:
    """Module path -> `blocks` of the Linears `load_transformer_file` keeps as their quantisation blocks
    from the file at `path`, read from its header alone (for the planner)."""
    header = _header(Path(path))
    return header.kept(checkpoint_keys(abstract_transformer(header.config), STACKED, key_map))


class _Header(NamedTuple):
    """What a transformer file's header says: its tensors, key prefix, quantised layers (stored layer ->
    format), stored shapes in BFL names, and the config they give."""

    source: object
    prefix: str
    formats: dict[str, str]
    stored: dict[str, tuple]
    config: TransformerConfig

    def kept(self, plan: dict[tuple, list[str]]) -> dict[tuple, str | tuple[str, ...]]:
        """The Linears of `plan` (`checkpoint_keys`) kept as blocks, with their `blocks`."""
        return kept_blocks(_stored_layers(plan, self.prefix), self.formats)


def _header(path: Path) -> _Header:
    source = _open(path)
    prefix = _prefix(source.keys(), path)
    # Stored layer -> its quantised format: FP8 or NVFP4 from a safetensors header, a GGUF file's ggml type.
    if isinstance(source, TensorSource):
        formats = quantised_layers(source, str(path))
    else:
        formats = gguf_formats(source.header)
    stored = _stored_shapes(source, prefix, formats)
    return _Header(source, prefix, formats, stored, bfl.config_from_bfl(stored, str(path)))


def _stored_shapes(source, prefix: str, formats: dict[str, str]) -> dict[str, tuple]:
    """Each stored tensor's shape in BFL names, an NVFP4 weight's as the [out, in] it stands for."""
    shapes = {}
    for key in source.keys():
        if key.startswith(prefix):
            nvfp4 = formats.get(key.removesuffix(".weight")) == nvfp4_file.FORMAT and key.endswith(".weight")
            shapes[key[len(prefix) :]] = nvfp4_file.logical_shape(source, key) if nvfp4 else source.shape(key)
    return shapes


def load_transformer_file(
    path: str | Path,
    dtype=jnp.float32,
    *,
    place=None,
    dequantize: bool = False,
    compute: str = products.BF16,
) -> Flux2Transformer:
    """The transformer of a BFL, FP8, NVFP4 or GGUF single file; `dequantize` widens quantised weights to
    `dtype` at load; `compute` is how the blocks' products are made (`klein.models.products`); `place` as
    `klein.io.loading.load_module`'s."""
    path = Path(path)
    # 1. What the file holds: naming, config (from the shapes), quantised layers; checked in BFL names.
    header = source, prefix, formats, stored, cfg = _header(path)
    fp8 = frozenset(layer for layer, fmt in formats.items() if fmt == FP8)
    plain = abstract_transformer(cfg)
    sides = {f"{layer}.{side}" for layer, fmt in formats.items() for side in _SIDE_TENSORS.get(fmt, ())}
    _check_layout(stored, expected_shapes(plain, STACKED, key_map), {k[len(prefix) :] for k in sides}, path)
    # 2. The model to fill: FP8 Linears and Linears of quantisation blocks where the whole stack has that
    # form (or 8-bit for 8-bit products), the compute dtype elsewhere.
    plan = checkpoint_keys(plain, STACKED, key_map)
    kept = set() if dequantize else _modules_in(plan, prefix, lambda layer: layer in fp8)
    keys = source.keys()
    scaled = kept & _modules_in(plan, prefix, lambda layer: f"{layer}.input_scale" in keys)
    blocks = {} if dequantize else header.kept(plan)
    forms = stored_forms(plan, kept, compute, scaled, blocks)
    abstract = abstract_transformer(cfg, dtype, forms)
    # 3. Read every diffusers key from its BFL tensor; quantised weights of the other modules are
    # dequantised, and quantised again per channel where the form says so.
    kept_forms = {module: form for module, form in forms.items() if not form.at_load}
    raw = {
        key
        for module, form in kept_forms.items()
        if not form.per_channel
        for key in plan[(*module, "kernel")]
    }
    as_blocks = {
        key: form.blocks
        for module, form in kept_forms.items()
        if form.blocks
        for key in plan[(*module, "kernel")]
    }
    blocks_of = operator.attrgetter("blocks") if isinstance(source, GGUFSource) else nvfp4_file.Blocks
    wanted = expected_shapes(abstract, STACKED, key_map)
    table = {key: _piece(key, prefix, formats, raw, as_blocks, blocks_of) for key in wanted}
    table = quantised_table(table, quantised_keys(plan, forms))
    mapped = MappedSource(source, table, dropped=sides - {f"{layer}.weight_scale" for layer in fp8})
    return load_module(abstract, mapped, dtype=None, stacked=STACKED, key_map=key_map, place=place)


def _open(path: Path):
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{path}: no such checkpoint file")
        return GGUFSource(path)
    return TensorSource.from_file(path)


def _prefix(keys: set[str], path: Path) -> str:
    for prefix in _PREFIXES:
        if prefix + _MARKER in keys:
            if f"{prefix}guidance_in.in_layer.weight" in keys:
                raise CheckpointError(
                    f"{path}: a FLUX.2 [dev] transformer (it has a guidance embedder), not klein"
                )
            return prefix
    raise CheckpointError(f"{path}: not a FLUX.2 [klein] transformer: {_what(keys)}")


def _what(keys: set[str]) -> str:
    """A guess at what a file that is not a transformer holds, for the error message."""
    if any(key.startswith(("encoder.", "decoder.")) for key in keys):
        return "it holds autoencoder (VAE) weights; pass it as the VAE"
    if any(".self_attn." in key for key in keys):
        return "it holds text encoder weights; pass it as the text encoder"
    if "single_stream_modulation.linear.weight" in keys:
        return "it has diffusers key names; pass the diffusers transformer folder (with its config.json)"
    return f"it has none of the FLUX.2 transformer's keys (such as '{_MARKER}')"


def _check_layout(stored: dict, diffusers: dict, scales: set[str], path: Path) -> None:
    """Compare the file with the BFL layout the model needs, in BFL key names (those the user can look up);
    `scales` are the quantised layers' side tensors."""
    expected = bfl.bfl_layout(diffusers)
    both = expected.keys() & stored.keys()
    problems = {
        "missing": sorted(expected.keys() - stored.keys()),
        "unexpected": sorted(stored.keys() - expected.keys() - scales),
        "wrongly shaped": sorted(
            f"{k} {stored[k]}, not {expected[k]}" for k in both if stored[k] != expected[k]
        ),
    }
    lines = [f"  {len(keys)} {what}: {', '.join(keys[:10])}" for what, keys in problems.items() if keys]
    if lines:
        raise CheckpointError(
            "\n".join([f"{path}: not the tensors of a FLUX.2 transformer in BFL layout:", *lines])
        )


def _modules_in(plan: dict[tuple, list[str]], prefix: str, test) -> set[tuple]:
    """Paths of the Linear modules whose stored layer passes `test` in every layer of their stack."""
    return {
        path[:-1]
        for path, layers in _stored_layers(plan, prefix).items()
        if path[-1] == "kernel" and all(test(layer) for layer in layers)
    }


def _stored_layers(plan: dict[tuple, list[str]], prefix: str) -> dict[tuple, set[str]]:
    return {
        path: {prefix + bfl.bfl_key(key).key.removesuffix(".weight") for key in keys}
        for path, keys in plan.items()
    }


def _piece(key: str, prefix: str, formats: dict[str, str], raw: set, blocks: dict, blocks_of):
    """How to read diffusers key `key` from a file's BFL tensors (`formats`: stored layer -> quantised
    format): weights of `raw` keys FP8 as shipped, those of `blocks` (key -> its stack's `blocks`) as the
    quantisation blocks `blocks_of(source)` gives (`klein.io.block_forms.layer_piece`); other quantised
    weights dequantised."""
    if key.endswith(".input_scale"):
        return Scalar(prefix + bfl.bfl_key(key).key)
    if key.endswith(".weight_scale"):
        stored = prefix + bfl.bfl_key(key).key
        layer = stored.removesuffix(".weight_scale")
        nvfp4 = formats.get(layer) == nvfp4_file.FORMAT
        return Scalar(f"{layer}.{nvfp4_file.TENSOR_SCALE}" if nvfp4 else stored)
    piece = bfl.piece(key, prefix)
    layer = piece.key.removesuffix(".weight")
    fmt = formats.get(layer)
    if key in blocks:
        return layer_piece(Viewed(piece, blocks_of), blocks[key], fmt)
    if fmt == nvfp4_file.FORMAT:
        return Viewed(piece, nvfp4_file.Values)
    if fmt == FP8 and key not in raw:
        return Dequantized(piece, f"{layer}.weight_scale")
    return piece
