"""A transformer step compiled for a TPU v5e from this machine (libtpu, no TPU), read from its optimised HLO:
the HBM bytes its top-level operations move per step (operands read and results written, logical sizes,
each while loop's body counted as many times as it runs), the number of transposes and copies, the
compiler's own estimated cycles where its backend config gives them, and XLA's cost analysis (which counts
each loop body once). The step is the pipeline's (`klein.aot.compiled`: the weights as the loader stores
them, the program `klein.pipeline.denoise` runs), 1024^2 text-to-image by default.

The figures compare two versions of the model's code on the same program, not a chip's time: run it before
and after a change and diff the JSON. `--top` lists the heaviest operations with XLA's name for what made
them (their `op_name`), to find where the bytes go.

    pip install -e ".[tpu]" && python benchmarks/tpu/tpu_step_hlo.py --model klein-4b --json step-hlo.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES.update({"s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1})
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$", re.S)
# Operations that move no HBM bytes of their own (views, tuples, control), or whose work is counted in
# the computations they call.
_FREE = {
    "parameter", "constant", "bitcast", "get-tuple-element", "tuple", "while", "call", "conditional",
    "copy-done", "async-done", "slice-done", "after-all", "partition-id", "replica-id", "iota",
}  # fmt: skip
_MOVES = ("copy", "copy-start", "transpose")


def shape_bytes(text: str) -> int:
    """Logical bytes of an HLO shape (an array or a tuple of them), padding of tiled layouts left out."""
    total = 0
    for dtype, dims in _ARRAY.findall(text.split(" ")[0] if not text.startswith("(") else text):
        if dtype not in _BYTES:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES[dtype]
    return total


def computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's name -> its lines (header first), an instruction whose text runs over several
    lines (a Pallas kernel's backend config) joined into one."""
    found, current = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            found[current] = [line]
        elif current is None:
            continue
        elif line.strip() == "}":
            current = None
        elif line.startswith("  ") or len(found[current]) == 1:
            found[current].append(line)
        else:
            found[current][-1] += "\n" + line
    return found


def entry_name(hlo: str) -> str:
    return re.search(r"^ENTRY %(\S+) ", hlo, re.M).group(1)


def _sliced_parameters(fused: list[str], comps: dict[str, list[str]]) -> dict[int, int]:
    """Parameter number -> bytes read, for the parameters of a fused computation read only through
    (dynamic) slices, here or in the fusions it nests: a layer sliced out of a whole stack inside the
    fusion reads that layer alone."""
    params, uses = {}, defaultdict(list)
    for line in fused[1:]:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        out, shape, opcode, rest = match.groups()
        if opcode == "parameter":
            params[out] = int(re.match(r"(\d+)\)", rest).group(1))
            continue
        operands = re.findall(r"%([^\s,()]+)", rest.split("), ")[0])
        nested = re.search(r"calls=%([^,\s]+)", rest) if opcode == "fusion" else None
        inner = (
            _sliced_parameters(comps[nested.group(1)], comps) if nested and nested.group(1) in comps else {}
        )
        for position, operand in enumerate(operands):
            if opcode in ("dynamic-slice", "slice") and position == 0:
                uses[operand].append(shape_bytes(shape))
            elif position in inner:
                uses[operand].append(inner[position])
            else:
                uses[operand].append(None)
    return {
        number: sum(uses[name])
        for name, number in params.items()
        if uses.get(name) and None not in uses[name]
    }


def trip_count(condition: list[str]) -> int:
    """A scan's trip count: the s32 constant its condition compares the counter with (1 if not found)."""
    constants = [int(m) for line in condition for m in re.findall(r"s32\[\]\S* constant\((\d+)\)", line)]
    return max(constants) if constants else 1


def tally(hlo: str) -> dict:
    """Per-step totals of the program `hlo` (optimised HLO text): bytes moved by its top-level operations,
    transposes and copies (counts and bytes), estimated cycles, while trip counts; and `ops`, every
    top-level operation's (name, opcode, bytes per step, times run, op_name)."""
    comps = computations(hlo)
    ops, loops = [], {}

    def walk(name: str, times: int) -> None:
        lines = comps[name]
        shapes = {}
        params = _HEADER.match(lines[0]).group(2)
        for pname, pshape in re.findall(r"(\S+): ((?:\([^)]*\))|\S+)(?:, |$)", params):
            shapes[pname] = pshape
        for line in lines[1:]:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            out, shape, opcode, rest = match.groups()
            shapes[out] = shape
            if opcode == "while":
                body = re.search(r"body=%([^,\s]+)", rest).group(1)
                condition = re.search(r"condition=%([^,\s]+)", rest).group(1)
                count = trip_count(comps[condition])
                loops[body] = count
                walk(body, times * count)
                continue
            if opcode in ("call", "conditional") or (opcode.startswith("async") and "calls=" in rest):
                for called in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%([^,\s}]+)", rest):
                    if called in comps:
                        walk(called, times)
            if opcode in _FREE:
                continue
            operand_text = rest.split("), ")[0]
            operands = re.findall(r"%([^\s,()]+)", operand_text)
            read = [shape_bytes(shapes.get(o, "")) for o in operands]
            fused = re.search(r"calls=%([^,\s]+)", rest) if opcode == "fusion" else None
            if fused and fused.group(1) in comps:
                sliced = _sliced_parameters(comps[fused.group(1)], comps)
                read = [sliced.get(i, whole) for i, whole in enumerate(read)]
            moved = shape_bytes(shape) + sum(read)
            cycles = re.search(r'"estimated_cycles":"(\d+)"', rest)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            ops.append(
                dict(
                    name=out,
                    opcode=opcode if target is None else f"custom-call:{target.group(1)}",
                    shape=shape.split("{")[0],
                    bytes=moved * times,
                    times=times,
                    cycles=int(cycles.group(1)) * times if cycles else 0,
                    op_name=op_name.group(1) if op_name else "",
                )
            )

    walk(entry_name(hlo), 1)
    by_opcode = defaultdict(lambda: dict(count=0, bytes=0, cycles=0))
    for op in ops:
        entry = by_opcode[op["opcode"]]
        entry["count"] += op["times"]
        entry["bytes"] += op["bytes"]
        entry["cycles"] += op["cycles"]
    moves = [op for op in ops if op["opcode"] in _MOVES]
    return dict(
        bytes=sum(op["bytes"] for op in ops),
        cycles=sum(op["cycles"] for op in ops),
        transposes_and_copies=sum(op["times"] for op in moves),
        transpose_and_copy_bytes=sum(op["bytes"] for op in moves),
        loops=sorted(loops.values()),
        by_opcode=dict(sorted(by_opcode.items(), key=lambda kv: -kv[1]["bytes"])),
        ops=ops,
    )


def compile_step(variant: str, compute: str, size: int, float_stacks: bool = False) -> tuple[str, dict]:
    """(optimised HLO text, XLA's cost analysis) of `variant`'s text-to-image step at size^2 compiled for
    one v5e chip. `float_stacks`: the weight stacks given as bf16, not as their bits (`klein.models.stacks`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from klein import sharding
    from klein.aot import compiled, topology
    from klein.memory import plan
    from klein.request import planning

    mesh, spec = topology.mesh("v5e:2x2", "single")
    work = planning.plan(variant, spec, 0, size=(size, size)).workload
    out = {}

    class Placer(compiled._Placer):
        def compile(self, stage, fn, stored, *args):
            if stage not in self.only:
                return
            graphdef, state = stored
            if float_stacks:
                state = jax.tree.map(
                    lambda a: a.update(dtype=jnp.bfloat16) if a.dtype == jnp.uint16 else a, state
                )
            program = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
            with sharding.use(self.mesh):
                executable = program.lower(state, *args).compile()
            cost = executable.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            out["hlo"] = executable.as_text()
            out["cost"] = {k: v for k, v in (cost or {}).items() if "{" not in k}

    saved, compiled._Placer = compiled._Placer, Placer
    try:
        compiled.analyse(
            plan.published(variant, "bfloat16"), work, "bfloat16", mesh, ("step",), compute=compute
        )
    finally:
        compiled._Placer = saved
    return out["hlo"], out["cost"]


def summary(counts: dict, top: int) -> str:
    lines = [
        f"bytes moved a step: {counts['bytes'] / 1e9:.2f} GB (loops run {counts['loops']})",
        f"transposes and copies a step: {counts['transposes_and_copies']}, "
        f"{counts['transpose_and_copy_bytes'] / 1e9:.2f} GB",
        f"estimated cycles a step: {counts['cycles'] / 1e6:.1f} M",
        "by opcode: count, GB, M cycles",
    ]
    for opcode, entry in counts["by_opcode"].items():
        lines.append(
            f"  {opcode:>28} {entry['count']:6d} {entry['bytes'] / 1e9:8.2f} {entry['cycles'] / 1e6:8.2f}"
        )
    if top:
        lines.append(f"heaviest {top} operations (GB a step, x times run, shape, op_name):")
        for op in sorted(counts["ops"], key=lambda op: -op["bytes"])[:top]:
            lines.append(
                f"  {op['bytes'] / 1e9:6.2f} x{op['times']:<3d} {op['opcode']:>10} {op['shape']:<28} {op['op_name']}"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="klein-4b", help="a published variant (default: %(default)s)")
    parser.add_argument("--compute", default="bf16", help="bf16 or int8 products (default: %(default)s)")
    parser.add_argument("--size", type=int, default=1024, help="image side, px (default: %(default)s)")
    parser.add_argument("--float-stacks", action="store_true", help="weight stacks as bf16, not their bits")
    parser.add_argument("--top", type=int, default=25, help="heaviest operations to list")
    parser.add_argument("--hlo", help="also write the optimised HLO text here")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    hlo, cost = compile_step(args.model, args.compute, args.size, args.float_stacks)
    counts = tally(hlo)
    print(summary(counts, args.top))
    print(f"XLA cost analysis (each loop body once): {json.dumps(cost)}")
    report = dict(model=args.model, compute=args.compute, size=args.size, float_stacks=args.float_stacks)
    report["cost_analysis"] = cost
    report.update({k: v for k, v in counts.items() if k != "ops"})
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(hlo)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the chip is compiled for, not used
    main()
