"""The LoRAs a request names: adapters loaded by name into the pipeline (`pipe.load_lora`), each at a
strength, applied unmerged to that request's images alone (docs/design.md, "LoRA per request").

A request names them as one set for every prompt, or one set per prompt (a batch of requests run
together). Spellings: `"ink"`, `"ink:0.8"`, `("ink", 0.8)`, `{"name": "ink", "scale": 0.8}` or a
`LoraUse`. A name is a name, never a path: what a name means is the pipeline's (or the operator's) to say.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from klein.errors import InputError

LoraSet = tuple["LoraUse", ...]


@dataclasses.dataclass(frozen=True)
class LoraUse:
    """One loaded LoRA at one strength."""

    name: str
    scale: float = 1.0


def as_loras(value, prompts: int) -> LoraSet | tuple[LoraSet, ...]:
    """The request's `loras` in one form: a set (tuple of `LoraUse`), or one set per prompt."""
    if value is None or value == ():
        return ()
    if isinstance(value, str | Mapping | LoraUse) or _is_pair(value):
        value = [value]
    if not isinstance(value, list | tuple):
        raise InputError(f"loras must be a list of LoRA names with scales, got {type(value).__name__}")
    if value and all(isinstance(item, list | tuple) and not _is_pair(item) for item in value):
        if len(value) != prompts:
            raise InputError(f"loras: {len(value)} sets given for {prompts} prompts; give one set per prompt")
        return tuple(_set(item) for item in value)
    return _set(value)


def per_prompt(loras, prompts: int) -> tuple[LoraSet, ...]:
    """One set per prompt, from either form `as_loras` returns."""
    if loras and isinstance(loras[0], tuple):
        return loras
    return (loras,) * prompts


def _set(items) -> LoraSet:
    uses = tuple(_use(item) for item in items)
    names = [use.name for use in uses]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InputError(f"loras: {twice[0]!r} is named twice in one set; give it once with its scale")
    return uses


def _is_pair(item) -> bool:
    return isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str) and _number(item[1])


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _use(item) -> LoraUse:
    if isinstance(item, LoraUse):
        name, scale = item.name, item.scale
    elif isinstance(item, Mapping):
        unknown = set(item) - {"name", "scale"}
        if unknown or "name" not in item:
            raise InputError(f"loras: each LoRA is {{'name': ..., 'scale': ...}}, got keys {sorted(item)}")
        name, scale = item["name"], item.get("scale", 1.0)
    elif isinstance(item, str):
        name, sep, tail = item.rpartition(":")
        name, scale = (name, _float(tail, item)) if sep else (item, 1.0)
    elif _is_pair(item):
        name, scale = item
    else:
        raise InputError(f"loras: a LoRA is a name, 'name:scale' or (name, scale), got {item!r:.100}")
    if not isinstance(name, str) or not name:
        raise InputError(f"loras: a LoRA's name must be a non-empty string, got {name!r:.100}")
    if _path_like(name):
        raise InputError(
            f"loras: {name!r:.100} is a path; a request names a loaded LoRA (pipe.load_lora, or the server's "
            "GET /v1/loras), never a file"
        )
    if not _number(scale) or not math.isfinite(scale):
        raise InputError(f"loras: the scale of {name!r} must be a finite number, got {scale!r:.50}")
    return LoraUse(name, float(scale))


def _path_like(name: str) -> bool:
    return any(mark in name for mark in ("/", "\\", "..", "~")) or name.startswith(".") or name[1:3] == ":\\"


def _float(text: str, item: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InputError(f"loras: {item!r}: the scale after ':' must be a number") from None
