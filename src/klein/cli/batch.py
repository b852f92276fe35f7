"""`klein batch REQUESTS.jsonl --out DIR`: a file of requests run to PNGs (`klein.batch`), in this process or,
with --ray, on Ray Data; every model flag of `klein generate`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from klein.cli import extras, limits
from klein.cli import flags as cli_flags
from klein.errors import InputError
from klein.version import version

EXIT_FAILED_LINES = 3

DESCRIPTION = """\
Run a file of requests, one JSON object a line, each with the settings of `klein generate` under its
key=value names (prompt, image, height, width, steps, guidance, num_images, seed, kv), e.g.
  {"prompt": "the cat wears the hat", "image": ["cat.png", "hat.png"], "seed": 7}
Image paths (or file:// URLs) are read relative to the file's folder; "loras": ["ink:0.8"] applies LoRAs
that --lora-dir / --lora-named offer. Requests are grouped by (reference set, LoRA set), so each set is
encoded once per worker. Each line's PNGs (line-NNNNN-<digest>.png, with the
metadata `klein generate` writes) are written whole or not at all, and DIR/results.jsonl records what
became of every line, and which model, LoRAs and settings made each output. A killed run continues with
--resume: finished lines are skipped; a resume with other model flags (model, LoRAs, variant, dtype)
than those that made DIR's outputs is refused unless --force.

Bad lines are reported with their numbers and the run goes on (--fail-fast stops at the first); a line
whose output is larger than --max-pixels (klein serve's limit, and klein generate's) is a bad line.
Exit codes: 0 every line done, 3 some lines failed, 2 bad arguments, 1 internal error, 130 stopped by
Ctrl+C (the lines done are kept: --resume continues)."""

EXAMPLES = """\
examples:
  klein batch edits.jsonl --out results/                     # demo checkpoint, in this process
  klein batch edits.jsonl --out results/ --resume            # after a kill: the rest only
  klein batch edits.jsonl --out results/ --ray --model black-forest-labs/FLUX.2-klein-9b-kv"""


def batch_parser() -> argparse.ArgumentParser:
    parser = cli_flags.Parser(
        prog="klein batch",
        description=DESCRIPTION,
        epilog=EXAMPLES,
    )
    add = parser.add_argument
    add("requests", metavar="REQUESTS.jsonl", type=Path, help="one JSON request per line")
    add("--out", required=True, type=Path, metavar="DIR", help="folder for the PNGs and results.jsonl")
    add("--resume", action="store_true", help="continue a run in DIR: skip the lines already written")
    add(
        "--force",
        action="store_true",
        help="with --resume: continue although DIR's outputs were made with another model, LoRA set, "
        "variant or dtype (each line's entry in results.jsonl records what made it)",
    )
    add("--fail-fast", action="store_true", help="stop at the first bad line or failed request")
    add(
        "--ray",
        action="store_true",
        help="run on Ray Data: a pool of actors, one per device, each with its own pipeline (needs pip "
        "install 'klein[ray]'); default: in this process",
    )
    add("--ray-address", metavar="ADDRESS", help="with --ray: join this Ray cluster (default: a local Ray)")
    add("--workers", type=int, metavar="N", help="with --ray: actors (default: one per GPU, else one)")
    cli_flags.add_max_pixels(add)
    cli_flags.add_flags(add, cli_flags.LOADING)
    return parser


def batch_command(flags: argparse.Namespace) -> int:
    from klein.batch import job

    if not flags.requests.is_file():
        raise InputError(f"{flags.requests}: no such file")
    if flags.force and not flags.resume:
        raise InputError("--force goes with --resume")
    if flags.max_pixels <= 0:
        raise InputError(f"--max-pixels must be a positive number, got {flags.max_pixels}")
    summary = job.run(
        flags.requests,
        flags.out,
        _executor(flags),
        flags.resume,
        flags.fail_fast,
        loading=cli_flags.load_options(flags),
        force=flags.force,
        check=lambda request: limits.check_pixels(request.height, request.width, flags.max_pixels),
    )
    print(summary.describe(flags.out), file=sys.stderr)
    return EXIT_FAILED_LINES if summary.failed else 0


def _executor(flags: argparse.Namespace):
    """Where the groups run: this process, or Ray Data (--ray)."""
    if not flags.ray:
        if flags.ray_address is not None or flags.workers is not None:
            raise InputError("--ray-address and --workers go with --ray")
        return _local(flags)
    if flags.workers is not None and flags.workers < 1:
        raise InputError(f"--workers must be a positive number, got {flags.workers}")
    extras.require("ray", "ray", "--ray")
    from klein.batch.ray_data import RayData
    from klein.pipeline.reading import locate

    loading = cli_flags.load_options(flags)
    locate(loading)  # a wrong --model is refused here, not by each actor in turn
    return RayData(loading, flags.out, version(), flags.ray_address, flags.workers)


def _local(flags: argparse.Namespace):
    from klein.batch.local import Local

    def load():
        from klein.pipeline.loading import load as load_pipeline

        return load_pipeline(cli_flags.load_options(flags))

    return Local(load, flags.out, version())
