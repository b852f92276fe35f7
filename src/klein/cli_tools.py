"""The `klein plan` and `klein bench` subcommands: their arguments and what they print.

Thin front ends over `klein.plan` and `klein.bench`, imported when the command runs so that
`klein --help` stays fast.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from klein.cli_args import Parser
from klein.dtypes import DTYPES
from klein.errors import InputError

PLAN_DESCRIPTION = """\
Per-device memory of a klein variant on a device mesh, from the real configs alone (no weights, no
devices): weights and the reference KV cache exactly, peak activations as an estimate."""


def plan_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="klein plan", description=PLAN_DESCRIPTION)
    add = parser.add_argument
    add(
        "--model",
        required=True,
        help="variant: klein-4b, klein-9b, klein-9b-kv, klein-base-4b, klein-base-9b",
    )
    add("--mesh", default="single", help='axis sizes, e.g. "fsdp=4,context=2" (default: single)')
    add("--refs", type=int, default=0, help="reference images (default: 0)")
    add("--size", type=_pixels, default=(1024, 1024), metavar="WxH", help="output size (default: 1024x1024)")
    add("--ref-size", type=_pixels, metavar="WxH", help="size of each reference (default: --size)")
    add("--batch", type=int, default=1, help="images per request (default: 1)")
    add("--dtype", choices=tuple(DTYPES), default="bfloat16", help="weights (default: bfloat16)")
    return parser


def _pixels(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in px, e.g. 1024x768, got {text!r}")
    return int(width), int(height)


def plan_command(flags: argparse.Namespace) -> int:
    """Print the per-device memory plan of `klein plan`."""
    from klein.plan import describe, plan

    memory = plan(flags.model, flags.mesh, flags.refs, flags.size, flags.ref_size, flags.batch, flags.dtype)
    print(describe(memory))
    return 0


BENCH_DESCRIPTION = """\
Time klein and diffusers side by side, in one process, on the same random weights, latents and
dtype: text-to-image, standard editing and KV editing (cache built in the run, and warm) with 1, 2
and 4 references, at two output sizes; best of interleaved rounds. Also measures the machine's matmul
peak and reports each engine's transformer FLOP/s and fraction of it. Prints a Markdown table and
writes <config>.json, .md and .png to --out. Needs the test extra (torch, diffusers, matplotlib):
pip install -e .[test]

configs: bench-cpu (scaled-down geometry, about 10 min on two quiet CPU cores), real-9b and real-4b (true
dimensions, bf16, for an accelerator), tiny (seconds; what CI runs). Random checkpoints are
written once under $KLEIN_HOME/bench."""


def bench_parser() -> argparse.ArgumentParser:
    from klein.bench.configs import CONFIGS

    parser = Parser(
        prog="klein bench",
        description=BENCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", choices=tuple(CONFIGS), default="bench-cpu", help="default: bench-cpu")
    parser.add_argument(
        "--out", default="results", metavar="FOLDER", help="results folder (default: results)"
    )
    parser.add_argument("--repeats", type=int, help="timed runs per engine and case (default: the config's)")
    parser.add_argument(
        "--sizes", type=int, nargs="+", metavar="PX", help="square output sizes (default: the config's two)"
    )
    return parser


def bench_command(flags: argparse.Namespace) -> int:
    """Run `klein bench`: the Markdown report on stdout, progress and written paths on stderr."""
    from klein.bench.configs import CONFIGS
    from klein.bench.report import markdown
    from klein.bench.runner import run_benchmark

    if flags.repeats is not None and flags.repeats < 1:
        raise InputError(f"--repeats must be a positive integer, got {flags.repeats}")
    config = CONFIGS[flags.config]
    if flags.sizes:
        if any(size < 16 or size % 16 for size in flags.sizes):
            raise InputError(f"--sizes must be multiples of 16 px, got {flags.sizes}")
        config = dataclasses.replace(config, output_sizes=tuple(flags.sizes))
    report, paths = run_benchmark(
        config, Path(flags.out), flags.repeats, log=lambda line: print(line, file=sys.stderr)
    )
    print(markdown(report))
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0
