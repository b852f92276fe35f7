"""What a run has left to do, and in which groups: finished lines are skipped (`--resume`), the rest
grouped by reference set and LoRA set so that each set is encoded once per worker (under its LoRAs).

A line whose files all exist but whose entry the manifest lacks (the job was killed between its last
PNG and its entry) is recorded from the files' own metadata rather than generated again.
"""

from __future__ import annotations

from pathlib import Path

import PIL.Image

from klein.batch import manifest, outputs
from klein.batch.lines import Line
from klein.batch.manifest import Manifest


def remaining(lines: list[Line], out: Path, record: Manifest) -> tuple[list[Line], int]:
    """(lines still to run, how many are finished already)."""
    todo, skipped = [], 0
    for line in lines:
        if not outputs.finished(out, line):
            todo.append(line)
            continue
        skipped += 1
        paths = outputs.targets(out, line)
        if record.entries.get(line.number, {}).get("outputs") != [path.name for path in paths]:
            record.add(manifest.done(line.number, paths, _seed(paths[0])))
    return todo, skipped


def _seed(path: Path) -> int | None:
    with PIL.Image.open(path) as image:
        seed = image.text.get("seed")
    return int(seed) if seed and seed.isdigit() else None


def groups(lines: list[Line]) -> list[list[Line]]:
    """Lines grouped by (reference set, LoRA set), groups in order of first appearance, lines in file
    order."""
    grouped: dict[tuple, list[Line]] = {}
    for line in lines:
        grouped.setdefault((line.reference_set, line.lora_set), []).append(line)
    return list(grouped.values())
