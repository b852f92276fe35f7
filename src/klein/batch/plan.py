"""What a run has left to do, and in which groups: finished lines are skipped (`--resume`), the rest grouped
by reference set and LoRA set so that each set is encoded once per worker."""

from __future__ import annotations

from pathlib import Path

from klein.batch import manifest, outputs
from klein.batch.lines import Line
from klein.batch.manifest import Manifest


def remaining(lines: list[Line], out: Path, record: Manifest) -> tuple[list[Line], dict[Path, dict]]:
    """(lines still to run, the entries of finished lines the manifest lacks, read from their files and
    keyed by the first: not yet added, so that they can be checked first)."""
    todo, recovered = [], {}
    for line in lines:
        if not outputs.finished(out, line):
            todo.append(line)
            continue
        paths = outputs.targets(out, line)
        if record.entries.get(line.number, {}).get("outputs") != [path.name for path in paths]:
            recovered[paths[0]] = _recovered(line, paths)
    return todo, recovered


def _recovered(line: Line, paths: list[Path]) -> dict:
    """The entry of finished `line` from its first file's metadata: its seed and what made it, if it says
    (one run writes all of a line's files)."""
    text = outputs.metadata(paths[0])
    seed, maker = text.get("seed"), outputs.made_by(paths[0], text)
    entry = manifest.done(line.number, paths, int(seed) if seed and seed.isdigit() else None)
    return entry | ({"made_by": maker} if maker is not None else {})


def groups(lines: list[Line]) -> list[list[Line]]:
    """Lines grouped by (reference set, LoRA set), groups in order of first appearance, lines in file
    order."""
    grouped: dict[tuple, list[Line]] = {}
    for line in lines:
        grouped.setdefault((line.reference_set, line.lora_set), []).append(line)
    return list(grouped.values())
