"""One `klein batch` run, whatever runs the groups (`local.Local`, `ray_data.RayData`): read the lines, report
the bad ones, skip what is finished, hand the groups to the executor and record every entry."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from klein.batch import manifest, plan, provenance
from klein.batch.lines import BadLine, Line, read_lines
from klein.batch.manifest import Manifest
from klein.errors import BATCH, InputError, worded
from klein.request.loading import LoadOptions
from klein.request.request import GenerationRequest


@dataclasses.dataclass
class Summary:
    done: int = 0
    skipped: int = 0
    failed: int = 0
    encodings: int = 0
    """Reference sets encoded in this run, over all workers."""

    def describe(self, out: Path) -> str:
        return (
            f"batch: {self.done} done, {self.skipped} already done, {self.failed} failed; "
            f"{self.encodings} reference encodings; results in {out / manifest.NAME}"
        )


def prepare_out(out: Path, resume: bool, made_by: dict, force: bool) -> Manifest:
    """The output folder (created if need be) and its manifest; a folder holding a batch's results is
    continued only with `resume`, and only by the model that made them (`made_by`) unless `force`, so that
    nothing is mixed up or replaced by accident."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a folder")
    out.mkdir(parents=True, exist_ok=True)
    held = (out / manifest.NAME).exists() or any(out.glob("line-*.png"))
    if held and not resume:
        raise InputError(
            f"{out} already holds a batch's results; pass --resume to continue it, or choose another --out"
        )
    record = Manifest(out)
    if not force:
        provenance.check_resume(record.makers(), made_by, out)
    record.path.touch()
    return record


def run(
    requests: Path,
    out: Path,
    executor,
    resume: bool,
    fail_fast: bool,
    *,
    loading: LoadOptions,
    force: bool = False,
    check: Callable[[GenerationRequest], None] | None = None,
) -> Summary:
    """Run every line of `requests` not finished in `out` with the pipeline `loading` loads (`executor`
    loads it); the counts. `force`: resume a folder whose outputs another model or LoRA set made. `check`:
    what the command refuses of a request before any model work (an `InputError`: the line is a bad line)."""
    read = [_checked(line, check) for line in read_lines(requests)]
    bad = [line for line in read if isinstance(line, BadLine)]
    if bad and fail_fast:
        raise InputError(f"{bad[0]} (--fail-fast)")
    made_by = provenance.made_by(loading)
    record = prepare_out(out, resume, made_by, force)
    summary = Summary(failed=len(bad))
    try:
        for line in bad:
            tqdm.write(f"error: {line}", file=sys.stderr)
            record.add(manifest.failed(line.number, line.message))
        lines = [line for line in read if isinstance(line, Line)]
        todo, recovered = plan.remaining(lines, out, record)
        for path, entry in recovered.items():
            if "made_by" in entry and not force:
                provenance.check_output(path, entry["made_by"], made_by)
            record.add(entry)
        summary.skipped = len(lines) - len(todo)
        if todo:
            _execute(todo, executor, record, summary, fail_fast, made_by)
    finally:
        record.compact()
    return summary


def _execute(
    todo: list[Line], executor, record: Manifest, summary: Summary, fail_fast: bool, made_by: dict
) -> None:
    total = summary.skipped + len(todo)
    with tqdm(total=total, initial=summary.skipped, desc="batch", unit="line", file=sys.stderr) as bar:
        for entry in executor.run(plan.groups(todo), made_by):
            bar.update()
            if entry["status"] == "done":
                record.add(entry | {"made_by": made_by})
                summary.done += 1
                continue
            record.add(entry)
            summary.failed += 1
            message = f"line {entry['line']}: {entry['error']}"
            if fail_fast:
                raise InputError(f"{message} (--fail-fast)")
            tqdm.write(f"error: {message}", file=sys.stderr)
    summary.encodings = executor.encodings


def _checked(line: Line | BadLine, check) -> Line | BadLine:
    """`line`, or the bad line `check` makes of its request."""
    if check is None or isinstance(line, BadLine):
        return line
    try:
        check(line.request)
    except InputError as error:
        return BadLine(line.number, worded(error, BATCH))
    return line
