"""Random LyCORIS adapters (LoKr, LoHa, with or without DoRA magnitudes, and LoRA modules beside them) for the
tiny transformer, written in each trainer's key layout, and the weights the reference implementation merges
from them: lycoris' functional `diff_weight` and `weight_decompose`, in float64 torch.

A module is its tensors by suffix ("lokr_w1", "hada_w1_a", "lora_down.weight", "alpha", "dora_scale", ...),
drawn so that its update is about a third of the weight it adapts (the weights are N(0, 1/in)).
"""

from pathlib import Path

import numpy as np
import torch
from lycoris.functional import loha as lycoris_loha
from lycoris.functional import lokr as lycoris_lokr
from lycoris.functional.general import factorization, weight_decompose
from safetensors.torch import save_file

from klein.io.bfl_transformer_keys import bfl_key
from tests.support.bfl_files import to_bfl

Module = dict[str, np.ndarray]

PREFIXES = {"bfl": "diffusion_model.", "kohya": "lora_unet_", "lycoris": "lycoris_", "peft": "transformer."}
"""layout -> key prefix: ai-toolkit (BFL names), kohya sd-scripts / musubi-tuner (BFL names, `_` for `.`),
LyCORIS' own wrapper as SimpleTuner uses it (diffusers names, `_` for `.`), diffusers / PEFT."""


def write(path: Path, modules: dict[str, Module], layout: str) -> Path:
    tensors = {}
    for module, parts in modules.items():
        name = module.replace(".", "_") if layout in ("kohya", "lycoris") else module
        for suffix, value in parts.items():
            tensors[f"{PREFIXES[layout]}{name}.{suffix}"] = torch.from_numpy(
                np.ascontiguousarray(value, np.float32)
            )
    save_file(tensors, str(path))
    return path


def normal(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def lokr(
    shape: tuple[int, int],
    rng,
    *,
    w1_rows: int | None = None,
    factor: int = -1,
    factored: tuple[str, ...] = ("w2",),
    rank: int = 2,
    tucker: bool = False,
    alpha: float | None = None,
) -> Module:
    """A LoKr module on a weight of `shape` [out, in], factors split as lycoris' `factorization` (or with
    `w1_rows` rows of w1); halves in `factored` are stored as `_a` / `_b` factors of `rank` (w2 with a Tucker
    core if `tucker`)."""
    out, fan_in = shape
    a, c = (w1_rows, out // w1_rows) if w1_rows else factorization(out, factor)
    b, d = factorization(fan_in, factor)
    parts = {}
    for half, (rows, cols) in (("w1", (a, b)), ("w2", (c, d))):
        if half not in factored:
            parts[f"lokr_{half}"] = normal(rng, rows, cols)
        elif tucker and half == "w2":
            parts |= {"lokr_w2_a": normal(rng, rank, rows), "lokr_t2": normal(rng, rank, rank)}
            parts["lokr_w2_b"] = normal(rng, rank, cols)
        else:
            parts |= {f"lokr_{half}_a": normal(rng, rows, rank), f"lokr_{half}_b": normal(rng, rank, cols)}
    return _sized(parts, alpha)


def loha(
    shape: tuple[int, int], rng, *, rank: int = 2, tucker: bool = False, alpha: float | None = None
) -> Module:
    """A LoHa module; with Tucker cores its ups are stored [rank, out], as lycoris stores them."""
    out, fan_in = shape
    parts = {}
    for i in "12":
        up = normal(rng, rank, out) if tucker else normal(rng, out, rank)
        parts |= {f"hada_w{i}_a": up, f"hada_w{i}_b": normal(rng, rank, fan_in)}
        if tucker:
            parts[f"hada_t{i}"] = normal(rng, rank, rank)
    return _sized(parts, alpha)


def lora(shape: tuple[int, int], rng, *, rank: int = 4, alpha: float | None = None) -> Module:
    """A LoRA (LoCon) module as kohya writes it."""
    out, fan_in = shape
    return _sized(
        {"lora_up.weight": normal(rng, out, rank), "lora_down.weight": normal(rng, rank, fan_in)}, alpha
    )


def with_dora(module: Module, weight: torch.Tensor, rng) -> Module:
    """`module` with a LyCORIS / kohya DoRA magnitude [out, 1]: the weight's row norms, each moved by up to
    30% as training would."""
    norms = weight.double().norm(dim=1, keepdim=True).numpy()
    return {**module, "dora_scale": (norms * rng.uniform(0.7, 1.3, norms.shape)).astype(np.float32)}


def _sized(parts: Module, alpha: float | None) -> Module:
    """`parts` with alpha, its first factor scaled so that the update is about a third of the weight."""
    if alpha is not None:
        parts["alpha"] = np.array(alpha, np.float32)
    d = delta(parts).numpy()
    first = next(k for k in ("lokr_w1", "lokr_w1_a", "hada_w1_a", "lora_up.weight") if k in parts)
    parts[first] = parts[first] * np.float32(0.35 / np.sqrt(d.shape[1]) / d.std())
    return parts


def _t(parts: Module, key: str) -> torch.Tensor | None:
    return None if key not in parts else torch.from_numpy(np.asarray(parts[key], np.float64))


def delta(parts: Module) -> torch.Tensor:
    """float64[out, in]: the module's update as lycoris' functional API computes it, its scale included."""
    alpha = None if "alpha" not in parts else float(parts["alpha"])
    if "lokr_w1" in parts or "lokr_w1_a" in parts:
        w = [_t(parts, f"lokr_{k}") for k in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b", "t2")]
        if w[6] is not None:  # functional.lokr reads the rank off w2_a, [rank, c] with a Tucker core
            rank = w[5].shape[0]
            return lycoris_lokr.kron_weight(*w, scale=1.0 if not alpha else alpha / rank, backend="torch")
        factored = w[1] if w[1] is not None else w[4]
        gamma = (
            alpha if alpha else (1.0 if factored is None else factored.shape[1])
        )  # lycoris: no alpha = rank
        return lycoris_lokr.diff_weight(*w, gamma=gamma, backend="torch")
    if "hada_w1_a" in parts:
        rank = parts["hada_w1_b"].shape[0]
        w = [_t(parts, f"hada_{k}") for k in ("w1_b", "w1_a", "w2_b", "w2_a", "t1", "t2")]
        return lycoris_loha.diff_weight(*w, gamma=1.0 if not alpha else alpha / rank, backend="torch")
    down, up = _t(parts, "lora_down.weight"), _t(parts, "lora_up.weight")
    return up @ down * (1.0 if alpha is None else alpha / down.shape[0])


def merged(weight: torch.Tensor, parts: Module, strength: float) -> torch.Tensor:
    """The weight with the module merged at `strength`: W + s * dW, or with a DoRA magnitude PEFT's rule,
    lycoris' `weight_decompose` of W + s * dW at multiplier 1."""
    weight = weight.double() + strength * delta(parts)
    if "dora_scale" not in parts:
        return weight
    return weight_decompose(weight, _t(parts, "dora_scale"), 1.0, wd_on_out=True, backend="torch")


def merged_state(
    state: dict[str, torch.Tensor], modules: dict[str, Module], naming: str, strength: float
) -> dict[str, torch.Tensor]:
    """A diffusers transformer state dict with `modules` (in "bfl" or "diffusers" naming) merged at
    `strength`, in float32."""
    named = to_bfl(state) if naming == "bfl" else dict(state)
    for module, parts in modules.items():
        named[f"{module}.weight"] = merged(named[f"{module}.weight"], parts, strength).float()
    return from_bfl(named, state) if naming == "bfl" else named


def from_bfl(bfl: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_bfl`: the diffusers state dict `like`'s keys, read from BFL tensors."""
    out = {}
    for key in like:
        source = bfl_key(key)
        piece = bfl[source.key].chunk(source.blocks)[source.block]
        out[key] = torch.cat(piece.chunk(2)[::-1]) if source.swapped else piece
    return out
