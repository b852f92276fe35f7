"""`results.jsonl`: one JSON object per line of the requests file, saying what became of it, appended as
lines finish and rewritten atomically, in line order, at the end of a run (docs/design/serving.md, "Batch").

    {"line": 7, "status": "done", "outputs": ["line-00007-ab12cd34.png"], "seed": 123,
     "settings": {"prompt": "...", "steps": 4, "kv": true, "model": "...", "loras": [...], ...},
     "made_by": {"model": "/models/klein-9b-kv", "lora": [["/loras/ink.safetensors", 0.8]], ...}}
    {"line": 9, "status": "error", "error": "image 'cat.png' not found (...)"}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from klein.io import durable

NAME = "results.jsonl"


class Manifest:
    def __init__(self, folder: Path):
        self.path = folder / NAME
        self.entries: dict[int, dict] = {}
        """Line number -> its latest entry."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):  # a tail torn by a kill (no final newline) is cut off
            with open(self.path, "r+b") as stream:
                stream.truncate(len(whole))
        for raw in whole.decode("utf-8").splitlines():
            entry = json.loads(raw)
            self.entries[entry["line"]] = entry

    def add(self, entry: dict) -> None:
        """Record an entry now: one append of one whole line."""
        self.entries[entry["line"]] = entry
        with open(self.path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(entry) + "\n")
            durable.flush(stream)

    def makers(self) -> list[dict]:
        """Each distinct `made_by` of the finished entries (none for lines recorded from PNGs written before
        PNGs carried it)."""
        found = []
        for entry in self.entries.values():
            if "made_by" in entry and entry["made_by"] not in found:
                found.append(entry["made_by"])
        return found

    def compact(self) -> None:
        """Rewrite the file with each line's latest entry once, in line order (temporary file + rename)."""
        temporary = self.path.with_name(f".{NAME}.tmp")
        with open(temporary, "w", encoding="utf-8") as stream:
            for number in sorted(self.entries):
                stream.write(json.dumps(self.entries[number]) + "\n")
            durable.flush(stream)
        os.replace(temporary, self.path)
        durable.sync_folder(self.path.parent)


def done(line: int, paths: list[Path], seed: int, warnings=(), settings: dict | None = None) -> dict:
    entry = {"line": line, "status": "done", "outputs": [path.name for path in paths], "seed": seed}
    return (
        entry
        | ({"warnings": list(warnings)} if warnings else {})
        | ({"settings": settings} if settings else {})
    )


def failed(line: int, message: str) -> dict:
    return {"line": line, "status": "error", "error": message}
