"""LoRA files as users name them: `style.safetensors`, `style.safetensors:0.8`, a folder or a Hugging Face
repo holding one `.safetensors`, or `(path_or_repo, scale)` from Python; and the sha256 that lets settings,
PNG metadata and caches name exactly which weights ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from pathlib import Path

from klein.errors import CheckpointError, InputError


@dataclasses.dataclass(frozen=True)
class LoraInfo:
    """Which LoRA ran, at which strength: what the settings and PNG metadata record."""

    name: str
    """The file or repo id as the user gave it."""
    scale: float
    sha256: str

    def describe(self) -> str:
        return f"{self.name}:{self.scale:g} (sha256 {self.sha256[:12]})"


def parse_spec(spec) -> tuple[str, float]:
    """`"FILE"`, `"FILE:SCALE"`, `(FILE, SCALE)` -> (FILE, SCALE); the scale defaults to 1."""
    if isinstance(spec, tuple | list):
        if len(spec) != 2:
            raise InputError(f"a LoRA is a path or (path, scale), got {spec!r}")
        name, scale = spec
        return os.fspath(name), _scale(scale, spec)
    if not isinstance(spec, str | os.PathLike):
        raise InputError(f"a LoRA is a path or (path, scale), got {type(spec).__name__}")
    text = os.fspath(spec)
    name, sep, tail = text.rpartition(":")
    # "C:\\x.safetensors" and "a:b/x" keep their colons: only a number after the last one is a scale.
    if sep and name and not Path(text).exists():
        try:
            return name, _scale(float(tail), text)
        except ValueError:
            pass
    return text, 1.0


MAX_SCALE = 100.0
"""The largest strength of a LoRA, merged or per request, either sign. LoRAs are used at about 0 to 2
(at most a few); at 100 an update is already a hundred times what it was trained at, and a bound well
inside float32 keeps a scale that is finite to JSON or Python (1e39) from becoming inf on the device
(an image of NaNs, black, without a word)."""


def good_scale(value) -> bool:
    """Whether `value` is a LoRA strength klein takes: a number within +-`MAX_SCALE`."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and abs(value) <= MAX_SCALE


def _scale(value, spec) -> float:
    if not good_scale(value):
        raise InputError(
            f"LoRA {spec!r}: the scale must be a number from -{MAX_SCALE:g} to {MAX_SCALE:g}, got {value!r:.50}"
        )
    return float(value)


def locate(name: str) -> Path:
    """The `.safetensors` file a LoRA name (without its scale) stands for."""
    path = Path(name).expanduser()
    if not path.exists():
        if path.suffix.lower() in (".safetensors", ".sft") or name.count("/") != 1:
            raise CheckpointError(f"LoRA {name}: no such file")
        from klein.io import sources  # here: it loads JAX, which naming a LoRA (`LoraInfo`) must not

        path = sources.resolve(name)[0]  # a repo id (or the error saying where it was looked for)
    if path.is_file():
        return path
    if not path.is_dir():  # a device, a pipe, a socket: nothing to read a LoRA from
        raise CheckpointError(
            f"LoRA {name}: not a file or a folder; give a .safetensors file, or a folder holding one"
        )
    found = sorted(path.glob("*.safetensors"))
    if len(found) != 1:
        listed = ", ".join(p.name for p in found) or "none"
        raise CheckpointError(
            f"LoRA {name}: a folder must hold exactly one .safetensors file (found {listed}); name the file"
        )
    return found[0]


def file_sha256(path: Path) -> str:
    """The hash that names a LoRA file in settings, metadata, cache keys and batch provenance."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
