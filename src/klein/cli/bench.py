"""The `klein bench` subcommand: its arguments and what it prints.

A thin front end over `klein.bench`, imported when the command runs so that `klein --help` stays fast.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from klein.cli.flags import Parser
from klein.errors import InputError

BENCH_DESCRIPTION = """\
Time klein and diffusers side by side, in one process, on the same random weights, latents and
dtype: text-to-image, standard editing and KV editing (cache built in the run, and warm) with 1, 2
and 4 references, at two output sizes; best of interleaved rounds. Also measures the machine's matmul
peak and reports each engine's transformer FLOP/s and fraction of it. Prints a Markdown table and
writes <config>.json, .md and .png to --out. Needs the test extra (torch, diffusers, matplotlib):
pip install -e .[test]

configs: bench-cpu (scaled-down geometry, about {minutes} min on two quiet CPU cores, float32),
bench-cpu-bf16 (the same in bf16, the precision users run), real-9b and real-4b (true dimensions,
bf16, for an accelerator), tiny (seconds; what CI runs). Random checkpoints are written once under
$KLEIN_HOME/bench."""


def bench_parser() -> argparse.ArgumentParser:
    from klein.bench.configs import CONFIGS

    parser = Parser(
        prog="klein bench",
        description=BENCH_DESCRIPTION.format(minutes=CONFIGS["bench-cpu"].minutes),
    )
    add = parser.add_argument
    add("--config", choices=tuple(CONFIGS), default="bench-cpu", help="default: bench-cpu")
    add("--out", default="results", metavar="FOLDER", help="results folder (default: results)")
    add("--repeats", type=int, help="timed runs per engine and case (default: the config's)")
    add("--sizes", type=int, nargs="+", metavar="PX", help="square output sizes (default: the config's two)")
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
        from klein.request.resolve import MULTIPLE

        if any(size < MULTIPLE or size % MULTIPLE for size in flags.sizes):
            raise InputError(f"--sizes must be multiples of {MULTIPLE} px, got {flags.sizes}")
        config = dataclasses.replace(config, output_sizes=tuple(flags.sizes))
    report, paths = run_benchmark(
        config, Path(flags.out), flags.repeats, log=lambda line: print(line, file=sys.stderr)
    )
    print(markdown(report))
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0
