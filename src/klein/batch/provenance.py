"""What made a batch's outputs: the loading options that change the images, and the LoRA files lines may
name (name -> sha256), in a canonical form that `results.jsonl` records with every finished line and
`--resume` compares before any model is loaded (docs/design/serving.md, "Batch").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from klein.errors import InputError
from klein.lora.files import file_sha256, parse_spec
from klein.lora.registry import named_files
from klein.request.loading import LoadOptions

MADE_BY = (
    "model",
    "transformer",
    "text_encoder",
    "vae",
    "tokenizer",
    "lora",
    "variant",
    "dequantize",
    "dtype",
    "compute",
    "kv_dtype",
    "text_encoder_weights",
)
"""The `LoadOptions` fields an output depends on."""
RECORDED = (*MADE_BY, "lora_offered")
"""What a record holds: those fields, and the LoRAs offered to lines by name (name -> sha256)."""

_DEFAULTS = {**{field.name: field.default for field in dataclasses.fields(LoadOptions)}, "lora_offered": {}}
"""What a record written before a field joined `RECORDED` was made with: that field's default."""


def made_by(options: LoadOptions) -> dict:
    """The JSON record of `options`' fields in `MADE_BY` (defaults included, so that "demo" given and
    "demo" by default are the same), and of the LoRAs they offer by name; an `InputError` for a
    --lora-dir or --lora-named that names no file."""
    record = {name: getattr(options, name) for name in MADE_BY}
    record["model"] = _where(record["model"] or "demo")
    for name in ("transformer", "text_encoder", "vae", "tokenizer"):
        record[name] = _where(record[name]) if record[name] is not None else None
    record["lora"] = [[_where(name), scale] for name, scale in map(parse_spec, options.lora)]
    offered = named_files(options.lora_dir, options.lora_named)
    record["lora_offered"] = {name: file_sha256(path) for name, path in sorted(offered.items())}
    return record


def _where(name: str) -> str:
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else str(name)


def check_resume(recorded: list[dict], now: dict, folder: Path) -> None:
    """Refuse (an `InputError`) to add outputs made otherwise than those `recorded` in `folder`."""
    for before in recorded:
        _refuse(before, now, f"{folder}'s outputs were")


def check_output(path: Path, before: dict, now: dict) -> None:
    """Refuse to count finished output `path`, whose entry results.jsonl lacks (the run stopped between the
    PNG and its entry), if the record `before` in its own metadata says it was made otherwise."""
    _refuse(before, now, f"{path} (finished, but not yet recorded in results.jsonl) was")


def _refuse(before: dict, now: dict, made: str) -> None:
    differences = [
        f"{name} {before.get(name, _DEFAULTS[name])!r} there, {now[name]!r} now"
        for name in RECORDED
        if before.get(name, _DEFAULTS[name]) != now[name]
    ]
    if differences:
        raise InputError(
            f"--resume: {made} made otherwise ({'; '.join(differences)}); resume with the same model "
            "flags, choose another --out, or pass --force to mix them knowingly"
        )
