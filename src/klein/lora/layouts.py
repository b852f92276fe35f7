"""The key layouts FLUX.2 adapter trainers write (the table in docs/loras.md), read into one form: per adapted
module, its update's form (`klein.lora.kinds`: LoRA / LoCon low-rank, LoHa Hadamard, LoKr Kronecker), the
scale the trainer meant (the kind's alpha rule folded in) and, for DoRA, the magnitude of each output row.
Module names stay as written (kohya's and LyCORIS's with `_` for `.`): `klein.lora.targets` maps them onto
the model. Adapter kinds klein does not apply (OFT, biases, full differences) are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter, defaultdict

import numpy as np

from klein.errors import CheckpointError
from klein.lora import kinds

# Key prefix -> layout name. Longest first: "model.diffusion_model." before "diffusion_model.".
LAYOUTS = {
    "transformer.": "diffusers / PEFT",
    "base_model.model.": "fal (PEFT-wrapped BFL names)",
    "model.diffusion_model.": "ComfyUI (BFL names)",
    "diffusion_model.": "BFL / ai-toolkit",
    "lora_unet_": "kohya / musubi-tuner",
    "lora_transformer_": "kohya-style with diffusers names (OneTrainer)",
    "lycoris_": "LyCORIS (SimpleTuner; diffusers names)",
}
FLATTENED = ("lora_unet_", "lora_transformer_", "lycoris_")
"""Layout prefixes whose module names have `_` for `.`."""
_BARE = "bare module names"

# Tensor name suffix -> the part of a module's update it holds. Longest first where one ends another.
_PARTS = {
    ".lora_A.weight": "down",
    ".lora_down.weight": "down",
    ".lora_B.weight": "up",
    ".lora_up.weight": "up",
    **{f".hada_{p}": f"hada_{p}" for p in ("w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2")},
    **{f".lokr_{p}": f"lokr_{p}" for p in ("w1_a", "w1_b", "w2_a", "w2_b", "w1", "w2", "t2")},
    ".lora_magnitude_vector.weight": "magnitude",
    ".lora_magnitude_vector": "magnitude",
    ".dora_scale": "dora_scale",
    ".alpha": "alpha",
}
_KIND = {"down": "LoRA", "up": "LoRA", "hada": "LoHa", "lokr": "LoKr"}
_EXTRA = ("magnitude", "dora_scale", "alpha")
"""Parts that go with a module's update but are none by themselves."""

# Tensor name patterns of adapter kinds klein does not apply -> the name users know them by.
_UNSUPPORTED = {
    r"\.oft_(blocks|r)|\.oft_diag": "OFT (orthogonal fine-tuning)",
    r"\.a1\.weight$": "GLoRA (lycoris generalised LoRA)",
    r"\.on_input$": "(IA)^3 (lycoris scaling vectors)",
    r"\.w_norm$": "norm layer (lycoris norm fine-tuning)",
    r"\.lambda_layer$": "T-LoRA",
    r"\.lora_[AB]\.bias$|\.lora_(up|down)\.bias$": "LoRA with biases (FLUX.2 Linears have none)",
    r"\.diff(_b)?$": "full weight differences",
}
_METADATA_KEYS = ("lora_adapter_metadata", "transformer_lora_adapter_metadata")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapted module: the update is `scale * form.delta()` on its weight float[out, in], rescaled per
    output row to `magnitude` (DoRA) where that is given."""

    key: str
    """The file's key prefix of this module (before `.lora_A.weight`, `.lokr_w1` etc.), for messages."""
    module: str
    """Module name without the layout prefix, as written (diffusers or BFL naming; kohya flattened)."""
    form: kinds.Form
    scale: float
    magnitude: np.ndarray | None
    """DoRA: float32[out], the norm each output row of the adapted weight is given."""
    parts: dict[str, str]
    """part ("down", "lokr_w1", ...) -> the file's key holding it, for messages."""

    @property
    def kind(self) -> str:
        return f"{self.form.name} with DoRA" if self.magnitude is not None else self.form.name


@dataclasses.dataclass(frozen=True)
class Parsed:
    layout: str
    adapters: list[Adapter]
    stray: list[str]
    """Keys that are no part of an adapted module's update (listed as unmatched)."""


def parse(tensors: dict[str, np.ndarray], metadata: dict[str, str], where: str) -> Parsed:
    """Adapters of a LoRA / LyCORIS file's tensors; `where` names the file in errors."""
    _refuse_unsupported(tensors, where)
    modules: dict[str, dict[str, str]] = defaultdict(dict)
    stray = []
    for key in tensors:
        suffix = next((s for s in _PARTS if key.endswith(s)), None)
        if suffix is None:
            stray.append(key)
        else:
            modules[key.removesuffix(suffix)][_PARTS[suffix]] = key
    for key, parts in list(modules.items()):
        if all(part in _EXTRA for part in parts):  # an alpha or magnitude without an update
            stray.extend(parts.values())
            del modules[key]
    if not modules:
        raise CheckpointError(f"{where}: not a LoRA file: {_what(tensors)}")
    _refuse_unpaired(modules, where)
    prefix = _prefix(modules)
    alphas = _peft_alphas(metadata, where)
    adapters = [_adapter(key, prefix, tensors, modules[key], alphas, where) for key in sorted(modules)]
    return Parsed(LAYOUTS.get(prefix, _BARE), adapters, sorted(stray))


def _refuse_unsupported(tensors, where: str) -> None:
    for pattern, kind in _UNSUPPORTED.items():
        hits = sorted(k for k in tensors if re.search(pattern, k))
        if hits:
            raise CheckpointError(
                f"{where}: a {kind} adapter (e.g. '{hits[0]}'); klein applies LoRA, LoCon, LoHa, LoKr and "
                "DoRA adapters only. Convert it to LoRA, or use diffusers for this file."
            )


def _refuse_unpaired(modules: dict[str, dict[str, str]], where: str) -> None:
    unpaired = sorted(key for key, parts in modules.items() if ("down" in parts) != ("up" in parts))
    if unpaired:
        raise CheckpointError(
            f"{where}: LoRA modules with only one of their two matrices (down/A and up/B): "
            f"{', '.join(unpaired[:10])}"
        )


def _what(tensors) -> str:
    if any(k.endswith(("img_attn.qkv.weight", "attn.to_q.weight")) for k in tensors):
        return "it holds full transformer weights; load it as --transformer, not as a LoRA"
    example = next(iter(sorted(tensors)), "(no tensors)")
    return (
        "no LoRA ('.lora_A.weight', '.lora_down.weight'), LoHa ('.hada_w1_a') or LoKr ('.lokr_w1') tensors "
        f"(first key: '{example}')"
    )


def _prefix(modules) -> str:
    """The layout prefix most modules have (any prefix before none: a diffusers file may also hold
    `text_encoder.` modules); modules without it keep their whole key, and match nothing."""
    found = Counter(next((p for p in LAYOUTS if m.startswith(p)), "") for m in modules)
    return next((prefix for prefix, _ in found.most_common() if prefix), "")


def _adapter(key, prefix, tensors, parts: dict[str, str], alphas, where) -> Adapter:
    kinds_found = {_KIND[p.split("_")[0]] for p in parts if p not in _EXTRA}
    if len(kinds_found) > 1:
        raise CheckpointError(
            f"{where}: module '{key}' holds the tensors of more than one adapter kind "
            f"({', '.join(sorted(kinds_found))}); each module has one"
        )
    get = {part: tensors[name] for part, name in parts.items()}
    for part, array in get.items():
        if part not in _EXTRA and array.ndim != 2:
            raise CheckpointError(
                f"{where}: '{parts[part]}' has shape {array.shape}, not a matrix (convolution adapters "
                "do not apply to FLUX.2, whose adapted layers are all Linear)"
            )
    kind = kinds_found.pop()
    module = key.removeprefix(prefix)
    form, rank = {"LoRA": _low_rank, "LoHa": _hadamard, "LoKr": _kronecker}[kind](get, parts, key, where)
    alpha = get.get("alpha")
    if alpha is not None:
        alpha = float(alpha.reshape(-1)[0])
        scale = alpha / rank if kind == "LoRA" else _lycoris_scale(alpha, rank)
    else:
        scale = 1.0 if alphas is None else alphas(module, rank)
    ordered = dict(sorted(parts.items(), key=lambda item: item[0] in _EXTRA))  # the form's parts first
    return Adapter(key, module, form, scale, _magnitude(get, parts, form, where), ordered)


def _require(
    parts: dict[str, str], key: str, kind: str, needed: tuple[str, ...], where: str, instead: str = ""
) -> None:
    """A `CheckpointError` naming the tensors of `needed` the module lacks (`instead`: a whole tensor that
    would have done in place of them); an incomplete file is refused, never guessed at."""
    missing = [f"'{key}.{part}'" for part in needed if part not in parts]
    if missing:
        alternative = f" (or '{key}.{instead}' in their place)" if instead else ""
        raise CheckpointError(
            f"{where}: the {kind} module '{key}' lacks {', '.join(missing)}{alternative}; the file is "
            "incomplete: save or convert it again"
        )


def _chain(where: str, parts: dict[str, str], *pairs: tuple[str, np.ndarray, str, np.ndarray]) -> None:
    """Each (left, its matrix, right, its matrix) multiplies: left's columns = right's rows."""
    for left, a, right, b in pairs:
        if a.shape[1] != b.shape[0]:
            raise CheckpointError(
                f"{where}: '{parts[left]}' {a.shape} and '{parts[right]}' {b.shape} do not multiply "
                "(their inner sizes differ)"
            )


def _low_rank(get, parts, key, where) -> tuple[kinds.LowRank, int]:
    """LoRA / LoCon: up float[out, r] @ down float[r, in]; (form, r)."""
    down, up = get["down"], get["up"]
    _chain(where, parts, ("up", up, "down", down))
    return kinds.LowRank(down, up), down.shape[0]


def _lycoris_scale(alpha: float, rank: int | None) -> float:
    """LyCORIS's alpha rule for LoHa and LoKr: alpha / rank, a zero alpha counting as the rank (its saved
    `alpha` is already alpha * rank / sqrt(rank) for rs_lora, so the rule holds there too); 1 for a LoKr
    of two whole halves (rank None), whose alpha lycoris ignores."""
    return 1.0 if not alpha or rank is None else alpha / rank


def _hadamard(get, parts, key, where) -> tuple[kinds.Hadamard, int]:
    """LoHa: (w1_a @ w1_b) ⊙ (w2_a @ w2_b), w*_a float[out, r], w*_b float[r, in]; with Tucker cores t1, t2
    float[r, r] the ups are w*_a.T @ t* (w*_a then float[r, out]), as lycoris rebuilds them. (form, the rank:
    hada_w1_b's first axis)."""
    _require(parts, key, "LoHa", ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"), where)
    if ("hada_t1" in parts) != ("hada_t2" in parts):
        _require(parts, key, "Tucker LoHa", ("hada_t1", "hada_t2"), where)
    halves = []
    for i in "12":
        up, down, core = get[f"hada_w{i}_a"], get[f"hada_w{i}_b"], get.get(f"hada_t{i}")
        if core is not None:
            _chain(where, parts, (f"hada_t{i}", core, f"hada_w{i}_b", down))
            _chain(where, parts, (f"hada_w{i}_a", up.T, f"hada_t{i}", core))
            up = up.T @ core
        else:
            _chain(where, parts, (f"hada_w{i}_a", up, f"hada_w{i}_b", down))
        halves.append(kinds.LowRank(down, up))
    if halves[0].shape != halves[1].shape:
        raise CheckpointError(
            f"{where}: the LoHa module '{key}' has halves of different shapes {halves[0].shape} and "
            f"{halves[1].shape}"
        )
    return kinds.Hadamard(*halves), get["hada_w1_b"].shape[0]


def _kronecker(get, parts, key, where) -> tuple[kinds.Kronecker, int | None]:
    """LoKr: kron(w1, w2), each half whole (`lokr_w1`) or factored (`lokr_w1_a` [a, r] @ `lokr_w1_b` [r, b];
    w2 also as `lokr_w2_a`.T @ `lokr_t2` @ `lokr_w2_b`, a Tucker core t2 [r, r]). (form, r of the factored
    half, None when both halves are whole)."""
    halves, ranks = [], []
    for i in "12":
        whole, a, b = f"lokr_w{i}", f"lokr_w{i}_a", f"lokr_w{i}_b"
        if whole in parts:
            halves.append(get[whole])
            continue
        _require(parts, key, "LoKr", (a, b), where, instead=whole)
        core = get.get("lokr_t2") if i == "2" else None
        if core is None:
            _chain(where, parts, (a, get[a], b, get[b]))
            halves.append(get[a] @ get[b])
        else:
            _chain(where, parts, (a, get[a].T, "lokr_t2", core), ("lokr_t2", core, b, get[b]))
            halves.append(get[a].T @ core @ get[b])
        ranks.append(get[b].shape[0])
    return kinds.Kronecker(*halves), ranks[0] if ranks else None


def _magnitude(get, parts, form: kinds.Form, where) -> np.ndarray | None:
    """DoRA's magnitude per output row: PEFT's `lora_magnitude_vector` [out], or LyCORIS's / kohya's
    `dora_scale` [out, 1]; LyCORIS's per-input-column form ([1, in], wd_on_out=False) is refused."""
    part = next((p for p in ("magnitude", "dora_scale") if p in parts), None)
    if part is None:
        return None
    value, out = get[part], form.shape[0]
    if value.size != out or value.shape not in ((out,), (out, 1)):
        raise CheckpointError(
            f"{where}: '{parts[part]}' has shape {value.shape}; DoRA here needs one magnitude per output row "
            f"({out},) or ({out}, 1) (magnitudes per input column, lycoris' wd_on_out=False, are not supported)"
        )
    return value.reshape(out).astype(np.float32)


def _peft_alphas(metadata: dict[str, str], where: str):
    """`scale(module, rank)` from the PEFT config diffusers writes into the header, or None without one.
    A LoRA config: lora_alpha / rank (rslora: / sqrt(rank)); PEFT's LoKr / LoHa configs: alpha / r, both
    from the config (PEFT applies it to every module, whole halves too)."""
    raw = next((metadata[k] for k in _METADATA_KEYS if k in metadata), None)
    if raw is None:
        return None
    try:
        config = {k.removeprefix("transformer."): v for k, v in json.loads(raw).items()}
        lora = "lora_alpha" in config
        alpha = float(config["lora_alpha" if lora else "alpha"])
        alphas = _patterns(config.get("alpha_pattern"))
        ranks = {} if lora else _patterns(config.get("rank_pattern"))
        r = None if lora else float(config["r"])
        rs = bool(config.get("use_rslora", False))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}: unreadable LoRA config in the safetensors header ({exc})") from None
    numbers = {"lora_alpha" if lora else "alpha": alpha, "r": r}
    numbers |= {f"alpha_pattern[{k!r}]": v for k, v in alphas.items()}
    numbers |= {f"rank_pattern[{k!r}]": v for k, v in ranks.items()}
    for name, value in numbers.items():
        if value is not None and not math.isfinite(value):
            # JSON from Python may spell NaN and Infinity, and each would make every image black.
            raise CheckpointError(
                f"{where}: the LoRA config in the safetensors header says {name} is {value}; it must be a "
                "finite number (the file was saved from a training run that diverged, or its header damaged)"
            )

    def scale(module: str, rank: int | None) -> float:
        a = _matching(alphas, module, alpha)
        if not lora:
            return a / _matching(ranks, module, r)
        if rank is None:  # a LoKr of two whole halves under a LoRA config: no rank to divide by
            return 1.0
        return a / math.sqrt(rank) if rs else a / rank

    return scale


def _patterns(patterns) -> dict[str, float]:
    return {k.lstrip("^"): float(v) for k, v in (patterns or {}).items()}


def _matching(patterns: dict[str, float], module: str, default: float) -> float:
    return next((v for k, v in patterns.items() if module == k or module.endswith("." + k)), default)
