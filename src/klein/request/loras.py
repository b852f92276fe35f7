"""The LoRAs a request names, applied unmerged to its images alone (docs/design/lora.md, "LoRA per request").

One set for every prompt, or one per prompt; spelt the same in every front end: `"ink"`, `"ink:0.8"`,
`("ink", 0.8)`, `{"name": "ink", "scale": 0.8}` or a `LoraUse`. A name is never a path. Mistakes are
`WordedError`s, in the words of the front end that shows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from klein.errors import WordedError, did_you_mean
from klein.lora.files import MAX_SCALE, good_scale

LoraSet = tuple["LoraUse", ...]
KEYS = ("name", "scale")
"""The keys of a LoRA given as a mapping."""
_OTHER_KEYS = dict.fromkeys(("weight", "strength", "multiplier"), "scale")
_OTHER_KEYS |= dict.fromkeys(("adapter_name", "lora"), "name")
"""Other tools' names of `KEYS` (diffusers' adapter weights, ComfyUI's strength, kohya's multiplier)."""
SPELLINGS = "a name, 'name:scale', [name, scale] or {{'name': ..., 'scale': ...}}"


@dataclasses.dataclass(frozen=True)
class LoraUse:
    """One loaded LoRA at one strength."""

    name: str
    scale: float = 1.0


def as_loras(value, prompts: int) -> LoraSet | tuple[LoraSet, ...]:
    """The request's `loras` in one form: a set (tuple of `LoraUse`), or one set per prompt."""
    if value is None or value == ():
        return ()
    if isinstance(value, str | Mapping | LoraUse) or is_pair(value):
        value = [value]
    if not isinstance(value, list | tuple):
        raise WordedError(
            "{loras} must be a list of LoRAs, each " + SPELLINGS + "; got {kind}",
            "loras",
            kind=type(value).__name__,
        )
    if value and all(isinstance(item, list | tuple) and not is_pair(item) for item in value):
        if len(value) != prompts:
            raise WordedError(
                "{loras}: {sets} sets given for {prompts} prompts; give one set per prompt",
                "loras",
                sets=len(value),
                prompts=prompts,
            )
        return tuple(_set(item) for item in value)
    return _set(value)


def per_prompt(loras, prompts: int) -> tuple[LoraSet, ...]:
    """One set per prompt, from either form `as_loras` returns."""
    if loras and isinstance(loras[0], tuple):
        return loras
    return (loras,) * prompts


def _set(items) -> LoraSet:
    uses = tuple(_use(item, index) for index, item in enumerate(items))
    names = [use.name for use in uses]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise WordedError(
            "{loras}: {name!r:.100} is named twice in one set; give it once with its scale",
            "loras",
            name=twice[0],
        )
    return uses


def is_pair(item) -> bool:
    """Whether `item` is one LoRA as (name, scale), rather than a list of LoRAs."""
    return isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str) and _number(item[1])


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _use(item, index: int) -> LoraUse:
    if isinstance(item, LoraUse):
        name, scale = item.name, item.scale
    elif isinstance(item, Mapping):
        _check_keys(item, index)
        name, scale = item["name"], item.get("scale", 1.0)
    elif isinstance(item, str):
        name, sep, tail = item.rpartition(":")
        name, scale = (name, _float(tail, item)) if sep else (item, 1.0)
    elif is_pair(item):
        name, scale = item
    else:
        raise WordedError(
            "{loras}[{index}]: a LoRA is " + SPELLINGS + ", got {item!r:.100}",
            "loras",
            index=index,
            item=item,
        )
    if not isinstance(name, str) or not name:
        raise WordedError(
            "{loras}[{index}]: a LoRA's name must be a non-empty string, got {name!r:.100}",
            "loras",
            index=index,
            name=name,
        )
    if _path_like(name):
        raise WordedError("{loras}: {name!r:.100} {a_path}", "loras", name=name)
    if not good_scale(scale):
        raise WordedError(
            "{loras}: the scale of {name!r:.100} must be a number from -{most:g} to {most:g}, got {scale!r:.50}",
            "loras",
            name=name,
            most=MAX_SCALE,
            scale=scale,
        )
    return LoraUse(name, float(scale))


def _check_keys(item: Mapping, index: int) -> None:
    """A mapping's keys are `KEYS`, its name given: an unknown key is named with the nearest known one."""
    unknown = [key for key in item if key not in KEYS]
    if unknown:
        key = str(unknown[0])
        hint = f"; did you mean {_OTHER_KEYS[key]!r}?" if key in _OTHER_KEYS else did_you_mean(key, KEYS)
        if key in ("path", "file"):
            after = ": a LoRA is named, never given as a file; {offered}"
        else:
            after = "{hint}" if hint else "; a LoRA's {key}s are {keys}"
        raise WordedError(
            "unknown {key} {name!r:.60} in {loras}[{index}]" + after,
            "loras",
            name=key,
            index=index,
            hint=hint,
            keys=" and ".join(map(repr, KEYS)),
        )
    if "name" not in item:
        raise WordedError(
            "{loras}[{index}]: a LoRA's {key}s are {keys}; 'name' is missing",
            "loras",
            index=index,
            keys=" and ".join(map(repr, KEYS)),
        )


def _path_like(name: str) -> bool:
    return any(mark in name for mark in ("/", "\\", "..", "~")) or name.startswith(".") or name[1:3] == ":\\"


def _float(text: str, item: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise WordedError(
            "{loras}: {item!r:.100}: the scale after ':' must be a number", "loras", item=item
        ) from None
