"""klein beside diffusers on one GPU, in one command on a machine with nothing prepared: `klein bench`'s
runner (`klein.bench.runner`: the same random weights for both engines, interleaved timed rounds after a
warm-up, per-stage times, the transformer's share of the measured bf16 matmul peak, the KV speed-up
against its FLOP ceiling) over the cases a GPU user asks about:

- klein-9b-kv at 1024^2: text-to-image, and editing with 1 / 2 / 4 references of 1024^2: standard editing,
  KV editing with the cache built in the call (diffusers' `Flux2KleinKVPipeline` against klein's cached
  path) and with warm references (klein reuses the encoded references; diffusers cannot);
- klein-4b at 1024^2, text-to-image.

Full-size random weights (bf16) are written under $KLEIN_HOME/bench first (about 34 GB for klein-9b-kv
with its Qwen3-8B text encoder, 16 GB for klein-4b; a part's weights are removed after it unless
--keep-weights, so that both fit a 64 GiB disk). Each part writes <name>.json, .md and .png to --out and
the Markdown tables are printed. `--tiny` runs the same parts at toy size on the CPU in seconds (the CI
test, tests/test_gpu_side_by_side.py).

    python benchmarks/gpu/gpu_side_by_side.py --out results/gpu          # on the GPU machine
    python benchmarks/gpu/gpu_side_by_side.py --tiny --out /tmp/gpu-tiny  # anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

from klein.bench import report, runner
from klein.bench.configs import CONFIGS, BenchConfig

PARTS = ("9b-kv", "4b")


def parts(tiny: bool, repeats: int) -> list[BenchConfig]:
    """(klein-9b-kv editing and text-to-image, klein-4b text-to-image) at 1024^2, or their toy twins."""
    if tiny:
        kv = dataclasses.replace(
            CONFIGS["tiny"], name="gpu-tiny-kv", output_sizes=(32,), reference_counts=(1,), repeats=repeats
        )
        checkpoint = dataclasses.replace(kv.checkpoint, pipeline="Flux2KleinPipeline")
        plain = dataclasses.replace(kv, name="gpu-tiny", checkpoint=checkpoint, reference_counts=())
        return [kv, plain]
    kv = dataclasses.replace(CONFIGS["real-9b"], name="gpu-9b-kv", output_sizes=(1024,), repeats=repeats)
    plain = dataclasses.replace(
        CONFIGS["real-4b"], name="gpu-4b", output_sizes=(1024,), reference_counts=(), repeats=repeats
    )
    return [kv, plain]


def run(config: BenchConfig, out: Path, keep_weights: bool, command: str) -> dict:
    """One part: its report (also written to `out`), the weights removed afterwards unless kept."""
    started = time.perf_counter()
    result, _ = runner.run_benchmark(config, out, log=lambda line: print(line, file=sys.stderr, flush=True))
    result["command"] = command
    result["seconds_with_weights_and_compiles"] = round(time.perf_counter() - started, 1)
    for path in report.write(result, out):
        print(f"wrote {path}", file=sys.stderr)
    if not keep_weights:
        shutil.rmtree(runner.checkpoint_home(config), ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("results/gpu"), help="default: results/gpu")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on this machine's device (CI)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per part (default: 3)")
    parser.add_argument("--keep-weights", action="store_true", help="keep the random checkpoints")
    parser.add_argument("--part", choices=PARTS, help="run one part only (default: both)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be a positive integer, got {args.repeats}")
    command = "python benchmarks/gpu/gpu_side_by_side.py" + (" --tiny" if args.tiny else "")
    started = time.perf_counter()
    summary = {}
    chosen = [
        p for name, p in zip(PARTS, parts(args.tiny, args.repeats), strict=True) if args.part in (None, name)
    ]
    for config in chosen:
        result = run(config, args.out, args.keep_weights, command)
        summary[config.name] = result["seconds_with_weights_and_compiles"]
        print(report.markdown(result))
    summary["total"] = round(time.perf_counter() - started, 1)
    (args.out / "gpu-side-by-side-seconds.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"seconds per part, weights and compiles included: {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
