"""The key layouts FLUX.2 LoRA trainers write (the table in docs/loras.md), read into one form: per adapted
module, its down matrix float[r, in], up matrix float[out, r] and the scale the trainer meant. Module names
stay as written (kohya's with `_` for `.`): `klein.lora.targets` maps them onto the model. Adapter kinds
klein does not merge (LoHa, LoKr, DoRA, ...) are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter

import numpy as np

from klein.errors import CheckpointError

# Key prefix -> layout name. Longest first: "model.diffusion_model." before "diffusion_model.".
LAYOUTS = {
    "transformer.": "diffusers / PEFT",
    "base_model.model.": "fal (PEFT-wrapped BFL names)",
    "model.diffusion_model.": "ComfyUI (BFL names)",
    "diffusion_model.": "BFL / ai-toolkit",
    "lora_unet_": "kohya / musubi-tuner",
    "lora_transformer_": "kohya-style with diffusers names (OneTrainer)",
}
FLATTENED = ("lora_unet_", "lora_transformer_")
"""Layout prefixes whose module names have `_` for `.`."""
_BARE = "bare module names"

_DOWN = (".lora_A.weight", ".lora_down.weight")
_UP = (".lora_B.weight", ".lora_up.weight")
_ALPHA = ".alpha"

# Tensor name patterns of adapter kinds that are not a plain low-rank update -> the name users know them by.
_UNSUPPORTED = {
    r"\.hada_(w[12]_[ab]|t[12])$": "LoHa (lycoris hadamard product)",
    r"\.lokr_(w[12](_[ab])?|t2)$": "LoKr (lycoris Kronecker product)",
    r"\.(dora_scale|lora_magnitude_vector(\.\w+)?)$": "DoRA (weight-decomposed LoRA)",
    r"\.oft_(blocks|r)|\.oft_diag": "OFT (orthogonal fine-tuning)",
    r"\.lora_[AB]\.bias$|\.lora_(up|down)\.bias$": "LoRA with biases (FLUX.2 Linears have none)",
    r"\.diff(_b)?$": "full weight differences",
}
_METADATA_KEYS = ("lora_adapter_metadata", "transformer_lora_adapter_metadata")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapted module: the update is `scale * up @ down` on its weight float[out, in]."""

    key: str
    """The file's key prefix of this module (before `.lora_A.weight` etc.), for messages."""
    down_key: str
    up_key: str
    module: str
    """Module name without the layout prefix, as written (diffusers or BFL naming; kohya flattened)."""
    down: np.ndarray
    up: np.ndarray
    scale: float


@dataclasses.dataclass(frozen=True)
class Parsed:
    layout: str
    adapters: list[Adapter]
    stray: list[str]
    """Keys that are neither a LoRA matrix nor an alpha (listed as unmatched)."""


def parse(tensors: dict[str, np.ndarray], metadata: dict[str, str], where: str) -> Parsed:
    """Adapters of a LoRA file's tensors; `where` names the file in errors."""
    _refuse_unsupported(tensors, where)
    downs = {k.removesuffix(s): k for k in tensors for s in _DOWN if k.endswith(s)}
    ups = {k.removesuffix(s): k for k in tensors for s in _UP if k.endswith(s)}
    if not downs and not ups:
        raise CheckpointError(f"{where}: not a LoRA file: {_what(tensors)}")
    unpaired = sorted(set(downs) ^ set(ups))
    if unpaired:
        raise CheckpointError(
            f"{where}: LoRA modules with only one of their two matrices (down/A and up/B): "
            f"{', '.join(unpaired[:10])}"
        )
    prefix = _prefix(downs)
    alphas = _peft_alphas(metadata, where)
    adapters = [_adapter(key, prefix, tensors, downs[key], ups[key], alphas, where) for key in sorted(downs)]
    used = {*downs.values(), *ups.values(), *(f"{k}{_ALPHA}" for k in downs)}
    stray = sorted(set(tensors) - used)
    return Parsed(LAYOUTS.get(prefix, _BARE), adapters, stray)


def _refuse_unsupported(tensors, where: str) -> None:
    for pattern, kind in _UNSUPPORTED.items():
        hits = sorted(k for k in tensors if re.search(pattern, k))
        if hits:
            raise CheckpointError(
                f"{where}: a {kind} adapter (e.g. '{hits[0]}'); klein merges plain LoRA (low-rank A/B) only. "
                f"Convert it to LoRA, or use diffusers for this file."
            )


def _what(tensors) -> str:
    if any(k.endswith(("img_attn.qkv.weight", "attn.to_q.weight")) for k in tensors):
        return "it holds full transformer weights; load it as --transformer, not as a LoRA"
    example = next(iter(sorted(tensors)), "(no tensors)")
    return f"no '.lora_A.weight' / '.lora_down.weight' tensors (first key: '{example}')"


def _prefix(modules) -> str:
    """The layout prefix most modules have (any prefix before none: a diffusers file may also hold
    `text_encoder.` modules); modules without it keep their whole key, and match nothing."""
    found = Counter(next((p for p in LAYOUTS if m.startswith(p)), "") for m in modules)
    return next((prefix for prefix, _ in found.most_common() if prefix), "")


def _adapter(key, prefix, tensors, down_key, up_key, alphas, where) -> Adapter:
    down, up = tensors[down_key], tensors[up_key]
    if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
        raise CheckpointError(
            f"{where}: '{down_key}' {down.shape} and '{up_key}' {up.shape} are not a LoRA pair "
            f"(down [rank, in], up [out, rank]; 1x1 convolution LoRAs do not apply to FLUX.2)"
        )
    module = key.removeprefix(prefix)
    rank = down.shape[0]
    alpha = tensors.get(f"{key}{_ALPHA}")
    scale = alphas(module, rank) if alpha is None else float(alpha.reshape(())) / rank
    return Adapter(key, down_key, up_key, module, down, up, scale)


def _peft_alphas(metadata: dict[str, str], where: str):
    """`scale(module, rank)` from the PEFT config diffusers writes into the header; 1 without one."""
    raw = next((metadata[k] for k in _METADATA_KEYS if k in metadata), None)
    if raw is None:
        return lambda module, rank: 1.0
    try:
        config = {k.removeprefix("transformer."): v for k, v in json.loads(raw).items()}
        alpha = float(config["lora_alpha"])
        patterns = {k.lstrip("^"): float(v) for k, v in (config.get("alpha_pattern") or {}).items()}
        rs = bool(config.get("use_rslora", False))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}: unreadable LoRA config in the safetensors header ({exc})") from None

    def scale(module: str, rank: int) -> float:
        a = next((v for k, v in patterns.items() if module == k or module.endswith("." + k)), alpha)
        return a / math.sqrt(rank) if rs else a / rank

    return scale
