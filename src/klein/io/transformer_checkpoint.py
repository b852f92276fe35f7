"""Loading the FLUX.2 transformer from a diffusers `transformer/` folder, and how each of its Linears is
stored (`stored_forms`: bf16, FP8 as shipped, or quantised at load for 8-bit products)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from klein.io.json_file import read_json
from klein.io.loading import checkpoint_keys, expected_shapes, load_module
from klein.io.mapped import MappedSource
from klein.io.quantised import quantised_table
from klein.io.safetensors import TensorSource
from klein.models import products
from klein.models.abstract_keys import AbstractKeys
from klein.models.layers import SHIPPED_FP8, Stored, packed, quantised, store
from klein.models.transformer import Flux2Transformer
from klein.models.transformer_config import TransformerConfig

STACKED = ("transformer_blocks", "single_transformer_blocks")


def key_map(key: str) -> str:
    # Double blocks keep diffusers' `to_out` ModuleList (Linear, Dropout); single blocks have a plain Linear.
    if key.startswith("transformer_blocks."):
        return key.replace(".attn.to_out.", ".attn.to_out.0.")
    return key


def abstract_transformer(cfg: TransformerConfig, dtype=jnp.float32, forms=None) -> Flux2Transformer:
    """The transformer's shapes, its Linears stored as `forms` says (module path -> `Stored`): a module of
    its own for each caller (loading fills it), merged from shapes traced once per config, dtype and forms
    (a load asks for them three or four times)."""
    return nnx.merge(*_abstract_transformer(cfg, jnp.dtype(dtype), tuple(sorted((forms or {}).items()))))


@functools.cache
def _abstract_transformer(cfg: TransformerConfig, dtype, forms: tuple):
    return nnx.split(
        nnx.eval_shape(lambda: store(Flux2Transformer(cfg, rngs=AbstractKeys(), dtype=dtype), dict(forms)))
    )


def stored_forms(
    plan: dict[tuple, list[str]],
    shipped_fp8=frozenset(),
    compute=products.BF16,
    input_scaled=frozenset(),
    blocks: dict | None = None,
) -> dict:
    """How each Linear (module path) of the transformer whose checkpoint keys are `plan` is stored: those
    of the blocks (the products over every token) quantised for an 8-bit `compute`, FP8 ones as shipped
    where they are FP8 already and the compute is FP8 (with the file's activation scale where
    `input_scaled` says it gives one); other Linears of `shipped_fp8` as shipped, and those of `blocks`
    (module path -> block format) as the file's quantisation blocks, widened inside a bf16 product."""
    forms: dict[tuple, Stored] = dict.fromkeys(shipped_fp8, SHIPPED_FP8)
    forms.update({path: packed(kind) for path, kind in (blocks or {}).items()})
    for path in (path[:-1] for path in plan if path[-1] == "kernel" and path[0] in STACKED):
        if compute in products.BLOCK_SCALED:
            # A file's blocks of the compute's own format are multiplied as stored; others stay widened.
            kept = (blocks or {}).get(path)
            if kept == compute:
                forms[path] = dataclasses.replace(forms[path], compute=compute)
            elif kept is None and path not in shipped_fp8:
                forms[path] = quantised(compute)
        elif compute in products.EIGHT_BIT:
            if path in shipped_fp8 and compute == products.FP8:
                forms[path] = dataclasses.replace(
                    SHIPPED_FP8, compute=compute, input_scale=path in input_scaled
                )
            else:
                forms[path] = quantised(compute)
    return forms


def quantised_keys(plan: dict[tuple, list[str]], forms: dict) -> dict[str, str]:
    """The checkpoint keys of the weights `forms` quantise at load, each with its compute."""
    per_channel = {path: form for path, form in forms.items() if form.per_channel or form.at_load}
    return {key: form.compute for path, form in per_channel.items() for key in plan[(*path, "kernel")]}


def expected_transformer_keys(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys and PyTorch-layout shapes a transformer with this config must have."""
    return expected_shapes(abstract_transformer(cfg), STACKED, key_map)


def read_config(folder: str | Path) -> TransformerConfig:
    """The transformer config of a diffusers-layout transformer folder (`config.json`)."""
    return TransformerConfig.from_diffusers(read_json(Path(folder) / "config.json", "transformer config"))


def load_transformer(
    folder: str | Path, dtype=jnp.float32, *, place=None, compute=products.BF16
) -> Flux2Transformer:
    """Strictly load `<folder>/config.json` and its safetensors, the blocks quantised for 8-bit `compute`."""
    folder = Path(folder)
    cfg = read_config(folder)
    source = TensorSource.from_folder(folder, "diffusion_pytorch_model")
    plan = checkpoint_keys(abstract_transformer(cfg), STACKED, key_map)
    forms = stored_forms(plan, compute=compute)
    abstract = abstract_transformer(cfg, dtype, forms)
    mapped = MappedSource(source, quantised_table({}, quantised_keys(plan, forms)))
    # dtype None: every weight as the abstract model holds it (8-bit kernels stay 8-bit).
    return load_module(abstract, mapped, dtype=None, stacked=STACKED, key_map=key_map, place=place)
