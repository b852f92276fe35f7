"""klein-9b and klein-9b-kv at 1024^2 with 0 / 1 / 2 / 4 references of 1024^2, compiled for TPU slices from
this machine (libtpu, no TPU): XLA's memory analysis per device of each stage, and the roofline time per
image (`klein.bench.roofline`). Compiled and estimated, not run.

The text encoder and the decode are the same programs for both variants and every reference count, and
klein-9b-kv without references is klein-9b's text-to-image step: each program compiles once per slice.
Compiled analyses are kept in --raw, so that a second run only recomputes the report.

    pip install -e ".[tpu]" && python benchmarks/tpu_compiled.py
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host's own device; the slice is compiled for, not used

from klein.memory import plan  # noqa: E402
from klein.pipeline import compiled, topology  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SLICES = (("tpu7x:2x2x1", "context=2"), ("v6e:2x4", "tensor=8"))
"""(slice, mesh): TPU7x as maxdiffusion measured its KV speed-up (one chip, two devices, context 2); v6e-8
with the weights split eight ways (klein-9b's 36 GB of weights do not fit a 32 GB chip whole)."""
REFERENCES = (0, 1, 2, 4)


def cases():
    """(key, variant, references, stages) of every program to compile on a slice."""
    yield "shared", "klein-9b", 0, ("text", "step", "decode")
    for refs in REFERENCES[1:]:
        yield f"klein-9b/{refs}", "klein-9b", refs, ("step",)
        yield f"klein-9b-kv/{refs}", "klein-9b-kv", refs, ("prefill", "step")


def compile_all(raw: dict, save) -> None:
    for target, spec in SLICES:
        mesh, spec = topology.mesh(target, spec)
        for key, variant, refs, stages in cases():
            name = f"{target}|{spec}|{key}"
            if name in raw:
                continue
            started = time.perf_counter()
            work = plan.plan(variant, spec, refs).workload
            analyses = compiled.analyse(plan.published(variant, "bfloat16"), work, "bfloat16", mesh, stages)
            raw[name] = {stage: vars(a) for stage, a in analyses.items()}
            raw[name]["seconds"] = round(time.perf_counter() - started, 1)
            print(f"{name}: {raw[name]}", file=sys.stderr, flush=True)
            save()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--raw", type=Path, default=ROOT / "docs/benchmarks/tpu-compiled-raw.json")
    flags = parser.parse_args()
    raw = json.loads(flags.raw.read_text()) if flags.raw.exists() else {}
    compile_all(raw, lambda: flags.raw.write_text(json.dumps(raw, indent=1) + "\n"))


if __name__ == "__main__":
    main()
