"""Where a transformer step's time goes on this chip, read from the profiler: the step program of
`tpu_step_parts.py` ("full": klein-4b's 1024^2 text-to-image step as the pipeline runs it, `--steps` steps
chained in one program) traced with `jax.profiler` and the trace read back with its own Python API
(`jax.profiler.ProfileData`). Every operation the chip ran is summed by name and joined to the optimised
program's HLO: what it is (a product, the attention kernel, a transpose or copy, other fused element-wise
work), the bytes it reads and writes (`tpu_step_hlo.tally`) and the source line XLA names for it.

Prints ms a step by kind, then the heaviest operations (ms a step, GB/s, what made them); `--json` keeps them.
Runs on a TPU host; on another backend the trace may hold no device operations, and it says so.

    PYTHONPATH=src python benchmarks/tpu/tpu_step_profile.py [--compute int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu_step_hlo  # noqa: E402
import tpu_step_parts as parts  # noqa: E402

from klein.models import products  # noqa: E402

KINDS = ("product", "attention", "kernel", "layout", "other")


def kinds_of(hlo: str) -> dict[str, str]:
    """Each instruction's name -> its kind: "product" (a dot or convolution, fused or not), "attention" (splash's
    Pallas kernel), "kernel" (another Pallas kernel: klein's own), "layout" (a transpose or copy) or "other"."""
    comps = tpu_step_hlo.computations(hlo)

    def holds_product(name: str, seen: set) -> bool:
        if name in seen or name not in comps:
            return False
        seen.add(name)
        for line in comps[name][1:]:
            if re.search(r" (?:convolution|dot)\(", line):
                return True
            if any(holds_product(c, seen) for c in re.findall(r"calls=%([^,\s]+)", line)):
                return True
        return False

    found = {}
    for lines in comps.values():
        for line in lines[1:]:
            match = tpu_step_hlo._INSTRUCTION.match(line)
            if not match:
                continue
            name, _, opcode, rest = match.groups()
            if opcode in ("convolution", "dot"):
                kind = "product"
            elif opcode == "custom-call" and "tpu_custom_call" in rest:
                kind = "attention" if name.startswith("splash") else "kernel"
            elif opcode in ("transpose", "copy", "copy-start"):
                kind = "layout"
            elif opcode == "fusion" and any(
                holds_product(c, set()) for c in re.findall(r"calls=%([^,\s]+)", rest)
            ):
                kind = "product"
            else:
                kind = "other"
            found[name] = kind
    return found


def device_events(path: str) -> tuple[dict, float]:
    """({operation name: [total ns, count]} of the device's "XLA Ops" line, the "XLA Modules" line's ns).
    An event is named by its instruction's text ("fusion.3 = bf16[...] fusion(...)"): its name is kept. Loops
    and calls are left out: their events span the operations they run, which have events of their own."""
    data = jax.profiler.ProfileData.from_file(path)
    ops, modules = defaultdict(lambda: [0, 0]), 0.0
    for plane in data.planes:
        if not plane.name.startswith("/device:TPU:0"):
            continue
        for line in plane.lines:
            if line.name == "XLA Ops":
                for event in line.events:
                    name, _, text = event.name.partition(" = ")
                    if re.search(r"\) (?:while|call|conditional)\(", text) or re.match(
                        r"(?:while|call)\.", name
                    ):
                        continue
                    entry = ops[name.lstrip("%")]
                    entry[0] += event.duration_ns
                    entry[1] += 1
            elif line.name == "XLA Modules":
                modules += sum(event.duration_ns for event in line.events)
    return dict(ops), modules


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(parts.MODELS), default="klein-4b")
    parser.add_argument("--compute", choices=(products.BF16, products.INT8), default=products.BF16)
    parser.add_argument(
        "--steps", type=int, default=4, help="steps chained in one program (default: %(default)s)"
    )
    parser.add_argument("--runs", type=int, default=2, help="runs traced (default: %(default)s)")
    parser.add_argument(
        "--top", type=int, default=30, help="heaviest operations to list (default: %(default)s)"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    cfg = parts.MODELS[args.model]
    print(f"{jax.devices()[0].device_kind}, {args.model} {args.compute}", flush=True)
    graphdef, state = parts.stored_weights(cfg, args.compute)
    inputs = parts.step_inputs(cfg, parts.SIDE, parts.TEXT)
    program, _, _ = parts.variant_program(graphdef, "full", args.steps)
    executable = program.lower(state, *inputs).compile()
    hlo = executable.as_text()
    kinds, counts = kinds_of(hlo), tpu_step_hlo.tally(hlo)
    by_name = {op["name"]: op for op in counts["ops"]}
    jax.block_until_ready(executable(state, *inputs))  # warm
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(args.runs):
                jax.block_until_ready(executable(state, *inputs))
        traces = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        ops, modules = device_events(traces[0]) if traces else ({}, 0.0)
    if not ops:
        print("the trace holds no TPU operations (not a TPU, or the profiler saw none)")
        return {}
    per_step = args.runs * args.steps
    total = sum(ns for ns, _ in ops.values()) / per_step / 1e6
    by_kind = defaultdict(float)
    rows = []
    for name, (ns, count) in ops.items():
        ms = ns / per_step / 1e6
        kind = kinds.get(name, "other")
        by_kind[kind] += ms
        op = by_name.get(name, {})
        gb = op.get("bytes", 0) / args.steps / 1e9
        rows.append(
            dict(name=name, kind=kind, ms_per_step=ms, runs_per_step=count / per_step, gb_per_step=gb,
                 gb_per_s=gb / ms * 1e3 if ms else 0.0, op_name=op.get("op_name", ""), shape=op.get("shape", ""))
        )  # fmt: skip
    rows.sort(key=lambda r: -r["ms_per_step"])
    print(f"device operations {total:.2f} ms a step (the module: {modules / per_step / 1e6:.2f} ms a step)")
    for kind in KINDS:
        print(f"  {kind:>10}: {by_kind[kind]:8.2f} ms a step ({by_kind[kind] / total:5.1%})")
    print(f"heaviest {args.top} (ms a step, runs a step, GB a step, GB/s, kind, shape, op_name):")
    for r in rows[: args.top]:
        print(
            f"  {r['ms_per_step']:7.2f} x{r['runs_per_step']:<4.0f} {r['gb_per_step']:6.2f} {r['gb_per_s']:6.0f}"
            f" {r['kind']:>9} {r['shape']:<24} {r['op_name'][-90:]}"
        )
    report = dict(
        device=jax.devices()[0].device_kind, model=args.model, compute=args.compute, steps=args.steps,
        ms_per_step=total, module_ms_per_step=modules / per_step / 1e6, by_kind=dict(by_kind), ops=rows,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
