"""jax's persistent compilation cache, where klein keeps compiled programs between processes: which folder,
turning it on, what it holds, emptying it (`klein cache`). jax keys an entry on the program, jax, the
backend, the devices and the flags, so an upgrade compiles afresh (docs/design/compiling.md). Entries are
files `<program>-<hash>-cache`, with an `-atime` file beside each once read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

from klein.errors import InputError
from klein.io.paths import klein_home

ENTRY_SUFFIX = "-cache"
JAX_MIN_COMPILE_SECONDS = 1.0
"""jax's default `jax_persistent_cache_min_compile_time_secs`: a different value was chosen by the process."""
MIN_COMPILE_SECONDS = 0.2
"""Programs that took this long or longer to compile are kept on a CPU (jax's default keeps only those of 1 s)."""
ACCELERATOR_MIN_COMPILE_SECONDS = 0.0
"""On an accelerator every program is kept: a TPU's small programs (a reshape, a cast, the loading's
transposes) compile in 0.05-0.3 s each and read back from the cache in milliseconds, and a new process
met dozens of them in its load and first call."""


def folder() -> Path:
    """The folder a klein front end uses: the process's own (jax.config or JAX_COMPILATION_CACHE_DIR,
    which jax.config reads), else `$KLEIN_HOME/xla-cache`."""
    chosen = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return Path(chosen) if chosen else klein_home() / "xla-cache"


def enable() -> None:
    """Persist compiled programs so that a second process skips most compilation: in `folder()`, keeping
    programs that took `MIN_COMPILE_SECONDS` or more (every one on an accelerator), unless the process
    chose otherwise (a folder of its own: then its cache and threshold stand)."""
    if jax.config.jax_compilation_cache_dir is not None:
        return
    jax.config.update("jax_compilation_cache_dir", str(folder()))
    if jax.config.jax_persistent_cache_min_compile_time_secs == JAX_MIN_COMPILE_SECONDS:  # jax's, not chosen
        cpu = jax.devices()[0].platform == "cpu"
        threshold = MIN_COMPILE_SECONDS if cpu else ACCELERATOR_MIN_COMPILE_SECONDS
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


@dataclasses.dataclass(frozen=True)
class Contents:
    folder: Path
    entries: int
    """Compiled programs."""
    bytes: int
    """Of every file in the folder."""


def contents(where: Path | None = None) -> Contents:
    """What the cache folder (`folder()` unless `where`) holds; nothing when it does not exist yet."""
    where = folder() if where is None else where
    files = [path for path in where.iterdir() if path.is_file()] if where.is_dir() else []
    entries = sum(path.name.endswith(ENTRY_SUFFIX) for path in files)
    return Contents(where, entries, sum(path.stat().st_size for path in files))


def clear(where: Path | None = None) -> Contents:
    """Remove the cache's files (`folder()` unless `where`); what was removed. Only jax's own files go: a
    folder that holds anything else is refused, in case it was named by mistake."""
    held = contents(where)
    files = list(held.folder.iterdir()) if held.folder.is_dir() else []
    strangers = [path.name for path in files if not _jax_file(path)]
    if strangers:
        raise InputError(
            f"{held.folder} holds files that are not jax's compiled programs ({', '.join(strangers[:3])}); "
            "nothing was removed: check the folder, or remove it yourself"
        )
    for path in files:
        path.unlink()
    return held


def _jax_file(path: Path) -> bool:
    # The lock file: jax's, when `jax_compilation_cache_max_size` bounds the cache.
    return path.is_file() and (path.name.endswith((ENTRY_SUFFIX, "-atime")) or path.name == ".lockfile")
