"""Where a line's images go and how they are written: each PNG atomically, with the metadata `klein generate`
writes and the run's model flags (`made_by`). A line is finished when every one of its files exists."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import PIL.Image

from klein.batch.lines import Line
from klein.errors import InputError
from klein.io import png
from klein.request import kinds
from klein.request.kinds import settings_of, short_name
from klein.request.request import GenerationRequest

MADE_BY = "made_by"
"""The PNG text chunk holding the model flags of the run that wrote it (JSON)."""


def targets(out: Path, line: Line) -> list[Path]:
    """`line-00007-<digest>.png`, or `-0.png`, `-1.png`, ... for a line of several images."""
    return png.numbered(out / f"{line.stem}.png", line.images)


def finished(out: Path, line: Line) -> bool:
    return all(path.is_file() for path in targets(out, line))


def ran(line: Line, result):
    """The settings a `GenerationOutput` of `line` ran with, its references named as the line names them."""
    request = dataclasses.replace(result.settings.request, image=line.named)
    return dataclasses.replace(result.settings, request=request)


def write(out: Path, line: Line, images, settings, version: str, made_by: dict) -> list[Path]:
    """Write the images of `line`, made with `settings` (`ran`) by a run with model flags `made_by`, with
    their metadata."""
    paths = targets(out, line)
    for index, (image, path) in enumerate(zip(images, paths, strict=True)):
        text = settings.metadata(index, version) | {MADE_BY: json.dumps(made_by)}
        png.write_png(image, path, png.png_metadata(text), overwrite=True)
    return paths


def record(settings, version: str) -> dict:
    """What results.jsonl records of the settings a line ran with (`ran`): its first PNG's text chunks (less
    its index and Software), each value typed as JSON types it: numbers, booleans, null and lists, not the
    text a PNG holds ("height": 384, "kv": true)."""
    text = settings.metadata(0, version)
    return {key: _typed(key, value) for key, value in text.items() if key not in ("index", "Software")}


# Each text chunk's kind (`klein.request.kinds`), by the short name it is written under.
_KINDS = {short_name(field, spec): spec.kind for field, spec in settings_of(GenerationRequest) if spec.kind}
_WRITTEN_AS_JSON = (kinds.PATHS, kinds.LORAS)
_READ_BACK = (kinds.INT, kinds.FLOAT, kinds.FLOATS, kinds.BOOL, kinds.OPTIONAL_BOOL)


def _typed(key: str, text: str):
    kind = _KINDS.get(key)
    if kind in _WRITTEN_AS_JSON or key in ("loras", "lora_adapters"):
        return json.loads(text)
    if kind in _READ_BACK:
        value = kind.read(key, text)
        return list(value) if isinstance(value, tuple) else value
    if kind is kinds.PATH or kind is kinds.STEP_CACHE:
        return None if text in ("none", "off") else text
    if key == "reference_sizes":
        return text.split(",") if text else []
    return text


def metadata(path: Path) -> dict[str, str]:
    """The text chunks of finished output `path`; an `InputError` naming it if it cannot be read."""
    try:
        with PIL.Image.open(path) as image:
            return dict(getattr(image, "text", {}))
    except (OSError, ValueError, SyntaxError) as error:  # PIL's errors for a file that is no image
        raise InputError(f"--resume: cannot read {path} ({error}); delete it to run its line again") from None


def made_by(path: Path, text: dict[str, str]) -> dict | None:
    """The model flags finished output `path` records in its text chunks `text` (None: written before PNGs
    recorded them)."""
    if MADE_BY not in text:
        return None
    try:
        record = json.loads(text[MADE_BY])
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise InputError(
            f"--resume: {path} has an unreadable {MADE_BY} record; delete it to run its line again"
        )
    return record
