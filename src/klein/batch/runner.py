"""One batch worker: a pipeline and the folder its PNGs go to, run over one group of lines at a time, the
group's reference set encoded once. A line the pipeline refuses becomes an error entry; the group goes on."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from klein.batch import manifest, outputs
from klein.batch.lines import Line
from klein.errors import BATCH, InputError, worded


class Runner:
    def __init__(self, pipe, out: Path, version: str, made_by: dict):
        """`made_by`: the run's model flags (`klein.batch.provenance`), recorded in every PNG written."""
        self.pipe, self.out, self.version, self.made_by = pipe, out, version, made_by

    @property
    def encodings(self) -> int:
        """Reference sets this worker's pipeline has encoded (its own count of the work done)."""
        return self.pipe.counters["references"]

    def run(self, group: list[Line]) -> Iterator[dict]:
        """One manifest entry per line of `group`, each as soon as its files are written."""
        try:
            references = self._encode(group[0])
        except InputError as error:
            for line in group:
                yield manifest.failed(line.number, f"references: {worded(error, BATCH)}")
            return
        for line in group:
            yield self._generate(line, references)

    def _encode(self, line: Line):
        request = line.request
        if not request.image:
            return None
        return self.pipe.encode_references(
            request.image, request.use_kv, source=request.repaints, loras=request.lora_sets[0]
        )

    def _generate(self, line: Line, references) -> dict:
        request = line.request
        if request.padding_mask_crop is None:  # a crop around the mask changes the source: not shared
            request = dataclasses.replace(request, image=(), references=references)
        try:
            result = self.pipe.generate(request)
        except InputError as error:
            return manifest.failed(line.number, worded(error, BATCH))
        settings = outputs.ran(line, result)
        paths = outputs.write(self.out, line, result.images, settings, self.version, self.made_by)
        recorded = outputs.record(settings, self.version)
        return manifest.done(line.number, paths, result.seed, result.settings.notes, recorded)
