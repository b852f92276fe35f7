"""Where a line's images go and how they are written: each PNG atomically (`klein.io.png.write_png`:
a temporary file in the folder, then a rename), with the metadata `klein generate` writes.

A line is finished when every one of its files exists: a file exists only once it is whole, so a job
killed at any moment leaves finished lines, missing files, and no torn one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from klein.batch.lines import Line
from klein.io import png


def targets(out: Path, line: Line) -> list[Path]:
    """`line-00007-<digest>.png`, or `-0.png`, `-1.png`, ... for a line of several images."""
    return png.numbered(out / f"{line.stem}.png", line.images)


def finished(out: Path, line: Line) -> bool:
    return all(path.is_file() for path in targets(out, line))


def ran(line: Line, result):
    """The settings a `GenerationOutput` of `line` ran with, its references named as the line names them."""
    request = dataclasses.replace(result.settings.request, image=line.named)
    return dataclasses.replace(result.settings, request=request)


def write(out: Path, line: Line, images, settings, version: str) -> list[Path]:
    """Write the images of `line`, made with `settings` (`ran`), with their metadata."""
    paths = targets(out, line)
    for index, (image, path) in enumerate(zip(images, paths, strict=True)):
        png.write_png(image, path, png.png_metadata(settings.metadata(index, version)), overwrite=True)
    return paths
