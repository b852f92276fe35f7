"""`klein batch --ray`: the groups on Ray Data, one group a batch, over a pool of stateful actors (one per GPU
in the cluster, else one; `--workers` says otherwise), each a `runner.Runner` with its own pipeline."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray

from klein import ray_runtime
from klein.batch.lines import Line
from klein.batch.runner import Runner


class _Worker:
    """One actor of the pool: a pipeline, run over whole groups."""

    def __init__(self, groups: list[list[Line]], loading, out: str, version: str, made_by: dict):
        from klein.pipeline.loading import load

        self.groups, self.id = groups, uuid.uuid4().hex
        self.runner = Runner(load(loading), Path(out), version, made_by)

    def __call__(self, batch: dict) -> dict:
        entries = [entry for group in batch["group"] for entry in self.runner.run(self.groups[int(group)])]
        return {
            "entry": [json.dumps(entry) for entry in entries],
            "worker": [self.id] * len(entries),
            "encodings": [self.runner.encodings] * len(entries),
        }


class RayData:
    def __init__(self, loading, out: Path, version: str, address: str | None, workers: int | None):
        self.loading, self.out, self.version = loading, out, version
        self.address, self.workers = address, workers
        self.encodings = 0

    def run(self, groups: list[list[Line]], made_by: dict) -> Iterator[dict]:
        ray_runtime.start(self.address)
        try:
            yield from self._results(groups, made_by)
        finally:
            ray.shutdown()

    def _results(self, groups: list[list[Line]], made_by: dict) -> Iterator[dict]:
        ray.data.DataContext.get_current().enable_progress_bars = False  # klein draws its own
        workers = self.workers or max(1, ray_runtime.devices())
        rows = ray.data.from_items(
            [{"group": i} for i in range(len(groups))], override_num_blocks=len(groups)
        )
        results = rows.map_batches(
            _Worker,
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=workers),
            fn_constructor_kwargs={
                "groups": groups,
                "loading": self.loading,
                "out": str(self.out),
                "version": self.version,
                "made_by": made_by,
            },
            **ray_runtime.share(workers),
        )
        encodings: dict[str, int] = {}
        for row in results.iter_rows():
            encodings[row["worker"]] = max(encodings.get(row["worker"], 0), row["encodings"])
            self.encodings = sum(encodings.values())
            yield json.loads(row["entry"])
