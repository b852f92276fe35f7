"""Settings as text: how each kind of setting is read from a string and written to one, and `setting`, the
declaration of a field's documentation, kind and spellings. Values are read with `ast.literal_eval`, never
`eval`: `image_paths="['a.png','b.png']"` is a list, an unquoted prompt stays text.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

from klein.errors import InputError
from klein.request.loras import is_pair


def _literal(text: str) -> object:
    """The Python literal `text` spells, or `text` itself when it is not one (an unquoted prompt or path)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _none(text: str) -> bool:
    return text.strip().lower() == "none"


def read_text(key: str, text: str) -> str:
    value = _literal(text)
    # prompt=42 means the text "42"; only a quoted literal ('a cat') is unwrapped.
    return value if isinstance(value, str) else text


def _listed(key: str, text: str, example: str) -> object:
    """The literal `text` spells, an unquoted word as a list of one; a list that is no Python refused."""
    value = _literal(text)
    if not isinstance(value, str):
        return value
    if value.lstrip().startswith(("[", "(")):
        raise InputError(f"{key}={text} is not a valid Python list; quote each {example}")
    return (value,)


def read_paths(key: str, text: str) -> tuple[str, ...]:
    value = _listed(key, text, f"path, e.g. {key}=\"['a.png','b.png']\"")
    if isinstance(value, list | tuple) and all(isinstance(path, str) for path in value):
        return tuple(value)
    raise InputError(f"{key} must be a path or a list of paths like \"['a.png','b.png']\", got {text}")


_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
"""Numbers as text in ASCII digits only: Python's int() and float() also take other scripts' digits ("６４")
and underscores ("1_0"), which in a setting are a mistake, not 64 and 10."""


def read_int(key: str, text: str) -> int | None:
    if _none(text):
        return None
    # Not height=True (bool is an int subclass) nor 1_0 or 0x10: a plain integer.
    if _INTEGER.fullmatch(text.strip()) and len(text.strip()) <= 100:
        return int(text)
    raise InputError(f"{key} must be an integer in the digits 0-9, got {text!r:.60}")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_float(key: str, text: str) -> float | None:
    if _none(text):
        return None
    if _DECIMAL.fullmatch(text.strip()) and len(text.strip()) <= 100:
        return float(text)
    raise InputError(f"{key} must be a number in the digits 0-9, got {text!r:.60}")


_BOOL_WORDS = dict.fromkeys(("true", "yes", "on", "1"), True)
_BOOL_WORDS |= dict.fromkeys(("false", "no", "off", "0"), False)


UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20}
UNITS |= {"g": 2**30, "gb": 2**30, "gib": 2**30}
"""Binary units of a size: KB, MB and GB mean KiB, MiB and GiB, as memory is counted."""


def parse_size(text: str) -> int:
    """ "4096", "512KiB", "64 MiB", "2GiB" -> bytes (binary units; KB and MB mean KiB and MiB here)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS:
        raise InputError(f"{text!r} is not a size; give bytes or KiB/MiB/GiB, e.g. 512MiB or 2GiB")
    return int(float(match.group(1)) * UNITS[unit])


def read_size(key: str, text: str) -> int | None:
    if _none(text):
        return None
    try:
        return parse_size(text)
    except InputError as error:
        raise InputError(f"{key}: {error}") from None


def read_bool(key: str, text: str) -> bool:
    if text.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.strip().lower()]
    raise InputError(f"{key} must be True or False, got {text!r}")


def read_optional_bool(key: str, text: str) -> bool | None:
    # use_kv=None (or auto) restores the default: KV exactly when the checkpoint is a KV one and references are given.
    return None if text.strip().lower() in ("none", "auto") else read_bool(key, text)


def _write(value: object) -> str:
    return "none" if value is None else str(value)


def _write_path(value: object) -> str:
    """A path as itself; an image or array given in memory as a placeholder (it has no path to record)."""
    if value is None:
        return "none"
    return str(value) if isinstance(value, str | os.PathLike) else "<in memory>"


def read_path(key: str, text: str) -> str | None:
    return None if _none(text) else read_text(key, text)


def _write_paths(value: tuple) -> str:
    return json.dumps([str(path) for path in value], ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class Kind:
    """How one kind of setting is written as text and read back."""

    name: str
    read: Callable[[str, str], object]
    """(key, text) -> value; an `InputError` naming the key when the text is not such a value."""
    write: Callable[[object], str] = _write


def _write_loras(value: tuple) -> str:
    """One set of LoRAs (`klein.request.loras.LoraUse`s) as `read_paths` reads them back: ["ink:0.8"]."""
    return json.dumps([f"{use.name}:{use.scale!r}" for use in value], ensure_ascii=False)


def read_loras(key: str, text: str) -> tuple:
    """LoRAs as a key=value word gives them: one "NAME:SCALE", or a list in any spelling
    `klein.request.loras` reads ("['ink:0.8', ('pen', 1)]"), which checks them."""
    value = _listed(key, text, f"name, e.g. {key}=\"['ink:0.8']\"")
    if isinstance(value, list | tuple):
        return (tuple(value),) if is_pair(value) else tuple(value)
    raise InputError(
        f"{key} must be NAME[:SCALE] or a list of LoRAs like \"['ink:0.8', ('pen', 1)]\", got {text}"
    )


def read_floats(key: str, text: str) -> tuple[float, ...] | None:
    """Numbers as a list ("[1.0, 0.75, 0.5]") or joined by commas ("1,0.75,0.5"); one number is a list of one."""
    if _none(text):
        return None
    value = _literal(text)
    value = (value,) if isinstance(value, int | float) else value
    if isinstance(value, list | tuple) and value and all(_number(item) for item in value):
        return tuple(float(item) for item in value)
    raise InputError(f"{key} must be numbers joined by commas, e.g. {key}=1,0.75,0.5, got {text!r}")


def _write_floats(value) -> str:
    return "none" if value is None else ",".join(repr(item) for item in value)


def read_cache(key: str, text: str):
    """A step cache as `StepCache.parse` reads it: on, off, or NAME=VALUE words joined by commas."""
    from klein.request.step_cache import StepCache

    return StepCache.parse(text)


def _write_cache(value) -> str:
    return "off" if value is None else value.spec()


TEXT = Kind("text", read_text)
PATHS = Kind("paths", read_paths, _write_paths)
LORAS = Kind("loras", read_loras, _write_loras)
"""LoRAs by name with a scale each, "NAME:SCALE"; given once per LoRA, as paths are."""
PATH = Kind("path", read_path, _write_path)
INT = Kind("int", read_int)
FLOAT = Kind("float", read_float)
FLOATS = Kind("floats", read_floats, _write_floats)
"""Numbers joined by commas: 1,0.75,0.5."""
SIZE = Kind("size", read_size)
"""Bytes, written as a number with an optional binary unit: 9GiB, 512MiB."""
BOOL = Kind("bool", read_bool)
OPTIONAL_BOOL = Kind("optional bool", read_optional_bool)
STEP_CACHE = Kind("step cache", read_cache, _write_cache)
"""A step cache's settings (`klein.request.step_cache.StepCache`), "on" or NAME=VALUE words."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a request field is documented, spelled on the command line and written as text."""

    doc: str
    kind: Kind | None
    """How the value travels as text; None for values only Python can pass (arrays, encoded references)."""
    name: str | None = None
    """Short name: the flag (--name), the first key=value word and the PNG metadata key (default: the field's)."""
    aliases: tuple[str, ...] = ()
    """Further key=value words (the field name is always one)."""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    """The values a text setting may take; empty: any."""
    bounds: tuple[int, int | None] | None = None
    """(lowest, highest or None) of an integer setting, checked by the request and stated by every front end."""
    unit: str = ""


def setting(doc: str, kind: Kind | None, default: Any = None, **spelling) -> Any:
    return dataclasses.field(default=default, metadata={"setting": Setting(doc, kind, **spelling)})


def settings_of(cls) -> list[tuple[dataclasses.Field, Setting]]:
    """(field, setting) of every field of a dataclass declared with `setting`."""
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def short_name(field: dataclasses.Field, spec: Setting) -> str:
    return spec.name or field.name
