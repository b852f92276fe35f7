"""PNG files carrying their settings as text metadata, and where the images of one run go.

Files are never clobbered by accident: the output plan is checked before any model work, and each PNG is
written to a temporary file, synced, then published with a hard link (or, with overwrite, a rename).
"""

import dataclasses
import itertools
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import PIL.Image
from PIL.PngImagePlugin import PngInfo

from klein.errors import InputError
from klein.io import durable


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """Where the images of one run go: `file` (numbered when several), else fresh names in `folder`."""

    folder: Path
    file: Path | None
    overwrite: bool
    # Time of the run's start, for fresh names: klein-YYYYmmdd-HHMMSS-<seed>.png.
    stamp: str


@dataclasses.dataclass(frozen=True)
class Words:
    """How a front end names, for its messages, the output (`out`) and what to pass to replace files."""

    out: str
    overwrite: str


CLI = Words("--out", "--overwrite")
PYTHON = Words("path", "save(..., overwrite=True)")


def plan_outputs(out: str | None, count: int, overwrite: bool, words: Words = CLI) -> OutputPlan:
    """Check `--out` (`words.out`) before any model work: a writable folder, and nothing in the way."""
    path = Path(out).expanduser() if out is not None else None
    if path is None or path.is_dir() or out.endswith(("/", os.sep)):
        folder, file = path or Path.cwd(), None
    elif path.suffix.lower() != ".png":
        raise InputError(
            f"{words.out} {out}: klein writes PNG files; give a name ending in .png, or a folder"
        )
    else:
        folder, file = path.parent, path
    if not folder.is_dir():
        raise InputError(f"output folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"cannot write to output folder {folder}: permission denied")
    if file is not None and not overwrite:
        taken = [target for target in numbered(file, count) if target.exists()]
        if taken:
            raise InputError(
                f"{taken[0]} already exists; pass {words.overwrite} to replace it, or choose another "
                f"{words.out}"
            )
    return OutputPlan(folder, file, overwrite, time.strftime("%Y%m%d-%H%M%S"))


def numbered(file: Path, count: int) -> list[Path]:
    """`out.png` for one image; `out-0.png`, `out-1.png`, ... for several."""
    if count == 1:
        return [file]
    return [file.with_name(f"{file.stem}-{index}{file.suffix}") for index in range(count)]


def fresh_names(folder: Path, stem: str) -> Iterator[Path]:
    """`stem.png`, `stem-1.png`, `stem-2.png`, ...: the writer takes the first names that are free."""
    yield folder / f"{stem}.png"
    yield from (folder / f"{stem}-{index}.png" for index in itertools.count(1))


def write_images(
    images: Sequence[PIL.Image.Image], plan: OutputPlan, metadata: Sequence[PngInfo], seed: int
) -> list[Path]:
    """Write each image with its metadata as the plan says; returns the paths written."""
    if plan.file is not None:
        targets = numbered(plan.file, len(images))
        for image, target, info in zip(images, targets, metadata, strict=True):
            if not write_png(image, target, info, plan.overwrite):
                raise InputError(f"{target} appeared while klein was running; it was left untouched")
        return targets
    names = fresh_names(plan.folder, f"klein-{plan.stamp}-{seed}")
    written = []
    for image, info in zip(images, metadata, strict=True):
        written.append(next(name for name in names if write_png(image, name, info, overwrite=False)))
    return written


def write_png(image: PIL.Image.Image, path: Path, info: PngInfo, overwrite: bool) -> bool:
    """Write `image` to `path` atomically; False (and nothing written) if `path` exists and not `overwrite`."""
    if not overwrite and path.exists():
        return False
    with durable.temporary(path) as temporary:
        with open(temporary, "xb") as stream:
            image.save(stream, format="PNG", pnginfo=info)
            durable.flush(stream)
        published = _publish(temporary, path, overwrite)
        if published:
            durable.sync_folder(path.parent)
        return published


def _publish(temporary: Path, path: Path, overwrite: bool) -> bool:
    if overwrite:
        os.replace(temporary, path)
        return True
    try:
        # link() refuses an existing name, so a file created by another process meanwhile survives.
        os.link(temporary, path)
    except FileExistsError:
        return False
    except OSError:
        # Filesystems without hard links: check-then-rename is the best left.
        if path.exists():
            return False
        os.rename(temporary, path)
    return True


def png_metadata(fields: Mapping[str, object]) -> PngInfo:
    """PNG text chunks, one per field; PIL stores non-Latin-1 text (e.g. most prompts' emoji) as iTXt."""
    info = PngInfo()
    for key, value in fields.items():
        info.add_text(key, "none" if value is None else str(value))
    return info
