"""Where a LoRA's modules land in klein's transformer: per Linear kernel (and layer of a stacked one), its
update's form (`klein.lora.kinds`) and DoRA magnitudes, checked against the model. Module names resolve through the loaders' own
key maps, so an update follows the weight it adapts (docs/design/lora.md); errors name LoRAs for other
models and sizes, and every key that matches nothing.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from typing import NamedTuple

import numpy as np
from flax import nnx

from klein.errors import CheckpointError, counted
from klein.io import bfl_transformer_keys as bfl
from klein.io.loading import checkpoint_keys
from klein.io.transformer_checkpoint import STACKED, abstract_transformer, key_map
from klein.lora import kinds, layouts
from klein.models.transformer_config import TransformerConfig


class Target(NamedTuple):
    """A model kernel a LoRA module writes to, as rows `block` of `blocks` of the module's output."""

    path: tuple
    layer: int | None
    block: int = 0
    blocks: int = 1
    swapped: bool = False


class Update(NamedTuple):
    """`scale * form.delta()` (torch layout [out, in]) on layer `layer` of the kernel at `path`; with a
    `magnitude` (DoRA) each output row of the adapted weight is then rescaled to that norm."""

    path: tuple
    layer: int | None
    form: kinds.Form
    """This kernel's rows of the module's update."""
    scale: float
    magnitude: np.ndarray | None
    """DoRA: float32[out], this kernel's rows of the module's magnitudes; None for any other adapter."""


# Modules that exist only in other models of the family, by the model that has them.
_FOREIGN = {
    "FLUX.1": r"(^|[._])(img_mod|txt_mod|norm1(_context)?[._]linear|proj_mlp|time_text_embed|vector_in)"
    r"([._]|$)|single_blocks[._]\d+[._]modulation",
    "FLUX.2 [dev]": r"guidance_in|guidance_embedder",
}
_SIZES = {3072: "klein-4b", 4096: "klein-9b", 6144: "FLUX.2 [dev]"}
_LISTED = 12
_TEXT_ENCODER = ("text_encoder.", "lora_te", "te_")


def updates(parsed: layouts.Parsed, cfg: TransformerConfig, where: str) -> list[Update]:
    """The kernel updates of a parsed LoRA, or a `CheckpointError` naming what does not fit the model."""
    _refuse_other_models(parsed, cfg, where)
    table, shapes = _tables(cfg)
    flat = {name.replace(".", "_"): targets for name, targets in table.items()}
    names = flat if parsed.layout in {layouts.LAYOUTS[p] for p in layouts.FLATTENED} else table
    out, unmatched = [], list(parsed.stray)
    for adapter in parsed.adapters:
        found = names.get(adapter.module)
        if found is None:
            unmatched.append(adapter.key)
            continue
        _check_shapes(adapter, found, shapes, parsed, cfg, where)
        out.extend(u for target in found for u in _split(adapter, target, where))
    if unmatched:
        more = f" ... and {len(unmatched) - _LISTED} more" if len(unmatched) > _LISTED else ""
        encoder = any(key.startswith(_TEXT_ENCODER) for key in unmatched)
        raise CheckpointError(
            f"{where}: {counted(len(unmatched), 'LoRA key')} {'matches' if len(unmatched) == 1 else 'match'} no "
            "layer of the FLUX.2 [klein] transformer "
            f"({parsed.layout} layout): {', '.join(unmatched[:_LISTED])}{more}"
            + ("; klein merges transformer LoRAs only, not text encoder ones" if encoder else "")
        )
    return out


def _refuse_other_models(parsed: layouts.Parsed, cfg: TransformerConfig, where: str) -> None:
    names = [a.module for a in parsed.adapters] + parsed.stray
    for model, pattern in _FOREIGN.items():
        hit = next((n for n in names if re.search(pattern, n)), None)
        if hit is not None:
            raise CheckpointError(
                f"{where}: a LoRA for {model} (it adapts '{hit}', which {model} has and FLUX.2 [klein] does "
                f"not); klein loads LoRAs trained for FLUX.2 [klein]"
            )
    width = _lora_width(parsed)
    if width == 6144 and cfg.hidden != 6144:
        raise CheckpointError(
            f"{where}: a LoRA for FLUX.2 [dev] (width 6144); klein loads FLUX.2 [klein] LoRAs"
        )


def _lora_width(parsed: layouts.Parsed) -> int | None:
    widths = Counter(a.form.shape[1] for a in parsed.adapters)
    return widths.most_common(1)[0][0] if widths else None


def _size(width) -> str:
    return f"{_SIZES[width]} (width {width})" if width in _SIZES else f"width {width}"


def _check_shapes(adapter: layouts.Adapter, targets, shapes, parsed, cfg, where: str) -> None:
    d_in, d_out = shapes[targets[0].path][-2:]  # per layer
    want = (d_out * targets[0].blocks, d_in)
    if isinstance(adapter.form, kinds.LowRank):  # name the matrix that does not fit
        rank = adapter.form.down.shape[0]
        checks = (
            (f"'{adapter.parts['down']}'", adapter.form.down.shape, (rank, d_in)),
            (f"'{adapter.parts['up']}'", adapter.form.up.shape, (want[0], rank)),
        )
    else:
        checks = ((f"the {adapter.kind} update of '{adapter.key}'", adapter.form.shape, want),)
    for name, got, wanted in checks:
        if got != wanted:
            raise CheckpointError(
                f"{where}: made for another model size: {name} has shape {got}, this model needs {wanted}. "
                f"{_sizes(adapter.form.shape, want, _lora_width(parsed), cfg.hidden)}"
            )


def _sizes(lora: tuple[int, int], model: tuple[int, int], lora_width: int | None, width: int) -> str:
    """Which sizes differ, in words: the models' widths where they differ, else the layer's (out, in)."""
    if lora_width != width:
        return f"The LoRA is for {_size(lora_width)}, the model is {_size(width)}."
    return (
        f"The layer is {lora[0]} x {lora[1]} (outputs x inputs) in the LoRA, {model[0]} x {model[1]} in this "
        f"model: the LoRA is for a model of this width ({width}) whose layers have other sizes."
    )


def _split(adapter: layouts.Adapter, target: Target, where: str) -> list[Update]:
    """The updates of `target`'s rows of the module (its block of a fused module, halves swapped where the
    checkpoints' order differs: the final adaLN): one, or for a Kronecker product whose factors do not
    split at those rows a few whose sum they are (`kinds.Kronecker.row_terms`)."""
    if target.blocks == 1 and not target.swapped:
        return [Update(target.path, target.layer, adapter.form, adapter.scale, adapter.magnitude)]
    rows = adapter.form.shape[0] // target.blocks
    index = np.arange(target.block * rows, (target.block + 1) * rows)
    if target.swapped:
        index = np.concatenate([index[rows // 2 :], index[: rows // 2]])
    if isinstance(adapter.form, kinds.Kronecker):
        forms = adapter.form.row_terms(index)
    else:
        forms = [adapter.form.rows(index)]
    if adapter.magnitude is None:
        return [Update(target.path, target.layer, form, adapter.scale, None) for form in forms]
    if len(forms) > 1:  # DoRA's norm is of the whole update: it cannot be one of several
        raise CheckpointError(
            f"{where}: the {adapter.kind} module '{adapter.key}' cannot be applied: its Kronecker factors "
            f"({adapter.form.w1.shape[0]} x {adapter.form.w2.shape[0]} rows) do not split at the rows of the "
            f"fused module's parts ({rows} rows), which klein holds as separate weights "
            f"({'/'.join(map(str, target.path[:-1]))}). Use one trained on the separate projections "
            "(diffusers names), or with a Kronecker factor that divides each part (lycoris factor -1 does)."
        )
    return [Update(target.path, target.layer, forms[0], adapter.scale, adapter.magnitude[index])]


def kernel_shape(cfg: TransformerConfig, path: tuple) -> tuple:
    """The shape [L?, in, out] of the kernel at `path` (L for a stack of layers)."""
    return _tables(cfg)[1][path]


@functools.lru_cache(maxsize=8)
def _tables(cfg: TransformerConfig) -> tuple[dict[str, list[Target]], dict[tuple, tuple]]:
    """(module name -> targets, in diffusers and BFL names; parameter path -> shape, [L?, in, out] for a
    kernel)."""
    abstract = abstract_transformer(cfg)
    shapes = {path: v.get_value().shape for path, v in nnx.to_flat_state(nnx.state(abstract))}
    table: dict[str, list[Target]] = {}
    for path, keys in checkpoint_keys(abstract, STACKED, key_map).items():
        if path[-1] != "kernel":
            continue
        for i, key in enumerate(keys):
            layer = i if path[0] in STACKED else None
            table[key.removesuffix(".weight")] = [Target(path, layer)]
            source = bfl.bfl_key(key)
            fused = source.key.removesuffix(".weight")
            table.setdefault(fused, []).append(
                Target(path, layer, source.block, source.blocks, source.swapped)
            )
    for targets in table.values():
        targets.sort(key=lambda t: t.block)
    return table, shapes
