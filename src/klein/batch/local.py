"""`klein batch` in this process: one pipeline, loaded once there is work, runs every group in turn."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from klein.batch.lines import Line
from klein.batch.runner import Runner


class Local:
    def __init__(self, load: Callable[[], object], out: Path, version: str):
        self._load, self.out, self.version = load, out, version
        self.encodings = 0

    def run(self, groups: list[list[Line]], made_by: dict) -> Iterator[dict]:
        runner = Runner(self._load(), self.out, self.version, made_by)
        for group in groups:
            yield from runner.run(group)
            self.encodings = runner.encodings
