"""The lines of a `klein batch` file: one JSON object a line, each one `klein.GenerationRequest` under the
key=value names of `klein generate`, read off the request type's declarations. A line that cannot become a
request is a `BadLine` with its number and the reason, so one mistake does not stop a night's job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import urllib.parse
from pathlib import Path

from klein.errors import BATCH, InputError, did_you_mean, worded
from klein.request.kinds import settings_of, short_name
from klein.request.request import GenerationRequest

# Key -> field name, for every text-valued setting under each of its spellings.
KEYS = {
    key: field.name
    for field, spec in settings_of(GenerationRequest)
    if spec.kind is not None
    for key in (short_name(field, spec), field.name, *spec.aliases)
}

SHAPE = 'a line is one JSON object, e.g. {"prompt": "the cat wears the hat", "image": ["cat.png"], "seed": 7}'
"""What a line looks like, for the messages of a line that is not one."""


@dataclasses.dataclass(frozen=True)
class Line:
    number: int
    """1-based line number in the file."""
    request: GenerationRequest
    """The request, its reference images as absolute paths."""
    named: tuple[str, ...]
    """The reference images as the line names them: what the PNG metadata records."""
    digest: str
    """SHA-256 of the line's text: a changed line is new work, not a finished one."""

    @property
    def reference_set(self) -> tuple:
        """Lines with equal sets share one reference encoding (the images in order, KV use, and whether
        the first is a source to repaint, which is prepared differently)."""
        request = self.request
        return tuple(str(path) for path in request.image), request.use_kv, request.repaints

    @property
    def lora_set(self) -> frozenset:
        """The LoRAs (name and scale) the line applies, in any order: a reference set's keys and values on
        a KV checkpoint are prefilled under them, so lines share an encoding only with equal sets."""
        return frozenset(use for uses in self.request.lora_sets for use in uses)

    @property
    def images(self) -> int:
        return len(self.request.prompts) * self.request.num_images_per_prompt

    @property
    def stem(self) -> str:
        """The name its outputs share: the line number, then the line's own digest."""
        return f"line-{self.number:05d}-{self.digest[:8]}"


@dataclasses.dataclass(frozen=True)
class BadLine:
    number: int
    message: str

    def __str__(self) -> str:
        return f"line {self.number}: {self.message}"


def read_lines(path: Path) -> list[Line | BadLine]:
    """Every non-blank line of `path`, as a request or as the reason it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read {path}: {error}") from None
    folder = path.resolve().parent
    return [
        parse_line(number, raw, folder)
        for number, raw in enumerate(text.splitlines(), start=1)
        if raw.strip()
    ]


def parse_line(number: int, raw: str, folder: Path) -> Line | BadLine:
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as error:
        return BadLine(number, f"not JSON ({error.msg} at column {error.colno}); {SHAPE}")
    if not isinstance(values, dict):
        return BadLine(number, f"expected a JSON object, got {type(values).__name__}; {SHAPE}")
    try:
        fields = _fields(values)
        named = tuple(fields.pop("image", ()))
        images = tuple(_local_file(item, folder, "image") for item in named)
        if isinstance(fields.get("mask_image"), str):
            fields["mask_image"] = _local_file(fields["mask_image"], folder, "mask")
        request = GenerationRequest.create(**fields, image=images)
    except InputError as error:
        return BadLine(number, worded(error, BATCH))
    digest = hashlib.sha256(raw.strip().encode()).hexdigest()
    return Line(number, request, tuple(str(item) for item in named), digest)


def _fields(values: dict) -> dict:
    """The line's keys as field names; an unknown or repeated one is an `InputError`."""
    fields = {}
    for key, value in values.items():
        if key not in KEYS:
            hint = did_you_mean(key, KEYS) or f"; known keys: {', '.join(KEYS)}"
            raise InputError(f"unknown key {key!r:.60}{hint}")
        if KEYS[key] in fields:
            raise InputError(f"{KEYS[key]} is given twice (as {key!r} too)")
        fields[KEYS[key]] = value
    image = fields.get("image", [])
    fields["image"] = [image] if isinstance(image, str) else image
    if not isinstance(fields["image"], list) or not all(isinstance(i, str) for i in fields["image"]):
        raise InputError(f"image must be a path or a list of paths, got {image!r:.100}")
    return fields


def _local_file(item: str, folder: Path, what: str) -> Path:
    """The absolute path of a line's `what` ("image", "mask"): a path or file:// URL, relative to the
    requests file's folder."""
    parsed = urllib.parse.urlparse(item)
    if parsed.scheme == "file":
        item = urllib.parse.unquote(parsed.path)
    elif parsed.scheme and len(parsed.scheme) > 1:  # (a one-letter scheme is a Windows drive)
        raise InputError(f"{what} {item!r:.100}: only local files (paths or file:// URLs) are read")
    path = folder / Path(item).expanduser()
    if not path.is_file():
        raise InputError(f"{what} {item!r:.100} not found (looked for {path})")
    return path
