"""`klein cache`: where jax's persistent compilation cache is, what it holds, and emptying it
(`klein.pipeline.compilation_cache`)."""

from __future__ import annotations

import argparse

from klein.cli import flags as cli_flags
from klein.pipeline import compilation_cache

DESCRIPTION = """\
Show the persistent compilation cache: its folder, how many compiled programs it holds and their bytes.
`klein cache clear` empties it, asking nothing, and prints what it removed.

Every klein front end (klein generate, serve, batch, load_pipeline) keeps the programs it compiles there,
so that the next process skips most compiling. The folder is $JAX_COMPILATION_CACHE_DIR if set, else
$KLEIN_HOME/xla-cache (default ~/.cache/klein/xla-cache). jax keys each program on its HLO, versions,
devices and compile flags, so an upgrade or another model compiles anew; old entries stay until cleared
(unless jax_compilation_cache_max_size is set). Clearing is safe: programs are compiled again when needed."""


def cache_parser() -> argparse.ArgumentParser:
    parser = cli_flags.Parser(prog="klein cache", description=DESCRIPTION)
    parser.add_argument(
        "action", nargs="?", choices=("show", "clear"), default="show", help="show (default) or clear"
    )
    return parser


def cache_command(flags: argparse.Namespace) -> int:
    if flags.action == "clear":
        removed = compilation_cache.clear()
        print(f"removed {_held(removed)} from {removed.folder}")
        return 0
    held = compilation_cache.contents()
    print(f"compilation cache: {held.folder}")
    print(f"  {_held(held)}" + ("" if held.folder.is_dir() else " (the folder does not exist yet)"))
    return 0


def _held(contents: compilation_cache.Contents) -> str:
    programs = "program" if contents.entries == 1 else "programs"
    return f"{contents.entries} compiled {programs}, {contents.bytes / 2**20:.1f} MiB"
