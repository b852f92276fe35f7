"""The LoRAs an operator makes available by name (`--lora-dir DIR`, `--lora-named NAME=FILE`): the one place
where a LoRA name becomes a file, so no request can open one (docs/design/lora.md, "Names, never paths").
Names are short words, so that none can be mistaken for a path.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

from klein.errors import InputError, WordedError, did_you_mean

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A LoRA name: what a request may name and a listing shows."""


def named_files(lora_dir: str | None, named=()) -> dict[str, Path]:
    """name -> file of every LoRA the operator offers, checked (each a file, names valid and distinct)."""
    found: dict[str, Path] = {}
    if lora_dir is not None:
        folder = Path(lora_dir).expanduser()
        if not folder.is_dir():
            raise InputError(f"--lora-dir {lora_dir}: no such folder")
        for path in sorted(folder.glob("*.safetensors")):
            _add(found, path.stem, path, f"--lora-dir {lora_dir}")
    for spec in named:
        name, sep, file = str(spec).partition("=")
        if not sep or not file:
            raise InputError(f"--lora-named {spec!r}: give NAME=FILE, e.g. ink=loras/ink.safetensors")
        path = Path(file).expanduser()
        if not path.is_file():
            raise InputError(f"--lora-named {spec!r}: no such file {file}")
        _add(found, name, path, f"--lora-named {spec}")
    return found


def _add(found: dict[str, Path], name: str, path: Path, where: str) -> None:
    if not NAME.fullmatch(name) or ".." in name:
        raise InputError(
            f"{where}: {name!r} cannot be a LoRA name; use 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if name in found:
        raise InputError(f"{where}: the name {name!r} is taken twice ({found[name]} and {path}); rename one")
    found[name] = path


def check_known(sets, known: Collection[str]) -> None:
    """A `WordedError` for the first LoRA of `sets` whose name is not among the `known` (loaded or offered)
    names, with the nearest of them."""
    unknown = next((use.name for uses in sets for use in uses if use.name not in known), None)
    if unknown is not None:
        raise WordedError(
            "{loras}: no LoRA named {name!r:.100} is {loaded}{hint} ({loaded}: {known}); {offered}",
            "loras",
            name=unknown,
            hint=did_you_mean(unknown, known),
            known=", ".join(sorted(known)) or "none",
        )
