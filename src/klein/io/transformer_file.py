"""Loading the FLUX.2 transformer from one file, as downloaded from Black Forest Labs or the community.

Formats, told apart by the file itself:
- BFL safetensors (`flux-2-klein-9b.safetensors`): BFL key names (`klein.io.bfl_transformer_keys`) and no
  config, which is read off the tensor shapes. ComfyUI's `model.diffusion_model.` key prefix is accepted.
- BFL FP8 safetensors (`flux-2-klein-9b-fp8.safetensors`, `klein.io.fp8`): float8 weights stay float8 in
  device memory, each Linear scales them inside its matmul; or, with `dequantize=True`, they are widened to
  `dtype` at load (twice the memory in bf16, no per-step cast). A Linear of a scanned stack stays FP8 only
  if it is FP8 in every layer.
- GGUF (`*.gguf`, `klein.io.gguf_file`): BFL key names; dequantised to `dtype` at load.
For 8-bit products (`compute`) the blocks' weights are quantised as they are read
(`klein.io.transformer_checkpoint.stored_forms`); FP8 ones stay as shipped for FP8 products.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from klein.errors import CheckpointError
from klein.io import bfl_transformer_keys as bfl
from klein.io.fp8 import SIDE_TENSORS, fp8_layers
from klein.io.gguf_file import GGUFSource
from klein.io.loading import checkpoint_keys, expected_shapes, load_module
from klein.io.mapped import Dequantized, MappedSource, Scalar
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


def file_config(path: str | Path) -> TransformerConfig:
    """The config of a single-file transformer, from its tensor shapes alone (no weight is read)."""
    path = Path(path)
    source = _open(path)
    return bfl.config_from_bfl(_stored_shapes(source, _prefix(source.keys(), path)), str(path))


def _stored_shapes(source, prefix: str) -> dict[str, tuple]:
    return {key[len(prefix) :]: source.shape(key) for key in source.keys() if key.startswith(prefix)}


def load_transformer_file(
    path: str | Path,
    dtype=jnp.float32,
    *,
    place=None,
    dequantize: bool = False,
    compute: str = products.BF16,
) -> Flux2Transformer:
    """The transformer of a BFL, FP8 or GGUF single file (`klein.pipeline.checkpoints.variant_of_file`
    tells its variant); `dequantize` widens FP8 weights to `dtype` at load; `compute` is how the blocks'
    products are made (`klein.models.products`); `place` puts each weight on its device(s) (see
    `klein.io.loading.load_module`)."""
    path = Path(path)
    source = _open(path)
    # 1. What the file holds: naming, config (from the shapes), FP8 layers; checked in BFL names.
    prefix = _prefix(source.keys(), path)
    stored = _stored_shapes(source, prefix)
    cfg = bfl.config_from_bfl(stored, str(path))
    fp8 = fp8_layers(source, str(path)) if isinstance(source, TensorSource) else frozenset()
    plain = abstract_transformer(cfg)
    _check_layout(stored, expected_shapes(plain, STACKED, key_map), {f[len(prefix) :] for f in fp8}, path)
    # 2. The model to fill: FP8 Linears where the whole stack is FP8 (or 8-bit for 8-bit products), the
    # compute dtype elsewhere.
    plan = checkpoint_keys(plain, STACKED, key_map)
    kept = set() if dequantize else _fp8_modules(plan, fp8, prefix)
    forms = stored_forms(plan, kept, compute, _input_scaled(plan, kept, prefix, source.keys()))
    abstract = abstract_transformer(cfg, dtype, forms)
    # 3. Read every diffusers key from its BFL tensor; FP8 weights of the other modules are dequantised,
    # and quantised again per channel where the form says so.
    raw = {key for module, form in forms.items() if not form.per_channel for key in plan[(*module, "kernel")]}
    table = {key: _piece(key, prefix, fp8, raw) for key in expected_shapes(abstract, STACKED, key_map)}
    table = quantised_table(table, quantised_keys(plan, forms))
    unread = {f"{layer}.{side}" for layer in fp8 for side in SIDE_TENSORS if side != "weight_scale"}
    mapped = MappedSource(source, table, dropped=unread)
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


def _check_layout(stored: dict, diffusers: dict, fp8: set[str], path: Path) -> None:
    """Compare the file with the BFL layout the model needs, in BFL key names (those the user can look up)."""
    expected = bfl.bfl_layout(diffusers)
    scales = {f"{layer}.{side}" for layer in fp8 for side in SIDE_TENSORS}
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


def _fp8_modules(plan: dict[tuple, list[str]], fp8: frozenset[str], prefix: str) -> set[tuple]:
    """Paths of the Linear modules whose weights are FP8 in every layer of their stack."""
    modules = set()
    for path, keys in plan.items():
        layers = {prefix + bfl.bfl_key(key).key.removesuffix(".weight") for key in keys}
        if path[-1] == "kernel" and layers <= fp8:
            modules.add(path[:-1])
    return modules


def _input_scaled(plan: dict[tuple, list[str]], kept: set[tuple], prefix: str, keys: set[str]) -> set[tuple]:
    """Paths of the FP8 Linear modules whose file gives an activation scale (`input_scale`) in every layer."""
    scaled = set()
    for module in kept:
        layers = {prefix + bfl.bfl_key(key).key.removesuffix(".weight") for key in plan[(*module, "kernel")]}
        if all(f"{layer}.input_scale" in keys for layer in layers):
            scaled.add(module)
    return scaled


def _piece(key: str, prefix: str, fp8: frozenset[str], raw: set[str]):
    """How to read diffusers key `key`; FP8 weights not kept as FP8 (in `raw`) are dequantised."""
    if key.endswith((".weight_scale", ".input_scale")):
        return Scalar(prefix + bfl.bfl_key(key).key)
    piece = bfl.piece(key, prefix)
    layer = piece.key.removesuffix(".weight")
    return Dequantized(piece, f"{layer}.weight_scale") if layer in fp8 and key not in raw else piece
