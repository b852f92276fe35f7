"""Reading optimised HLO text (a program compiled for a GPU from this machine): the operations of a kind
with their result and operand types, for the GPU compile tests' assertions."""

import math
import re

_VALUE = re.compile(r"(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_PARAMETER = re.compile(r"([\w.\-]+): (\w+)\[([\d,]*)\]")
_OPERANDS = re.compile(r" (dot|convert|transpose|copy)\(%([\w.\-]+)(?:, %([\w.\-]+))?\)")


def dims_of(text: str) -> tuple[int, ...]:
    """The dimensions "2048,32,128" of an HLO shape as a tuple ("" for a scalar)."""
    return tuple(int(n) for n in text.split(",")) if text else ()


def operations(hlo: str, kind: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(result dtype, [(dtype, dims) of each operand]) of every `kind` ("dot", "convert", "transpose" or
    "copy") of an optimised HLO module, fused or not."""
    found, types = [], {}
    for line in hlo.splitlines():
        line = line.strip()
        if line.endswith("{") and " = " not in line:  # a computation's header: its parameters' types
            types = {name: (dtype, dims_of(dims)) for name, dtype, dims in _PARAMETER.findall(line)}
        value = _VALUE.match(line)
        if value is None:
            continue
        types[value.group(1)] = (value.group(2), dims_of(value.group(3)))
        operation = _OPERANDS.search(line)
        if operation and operation.group(1) == kind:
            found.append((value.group(2), [types[name] for name in operation.groups()[1:] if name]))
    return found


def dot_operands(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every operand of every matrix product."""
    return [operand for _, operands in operations(hlo, "dot") for operand in operands]


# An instruction of a non-fused computation: name, result type (array or tuple), opcode, operands, the rest.
_INSTRUCTION = re.compile(r"(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\w+\[[\d,]*\]\S*) ([\w\-]+)\(([^)]*)\)(.*)")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_NARROW = {"u8": 1, "s8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}


def _computations(hlo: str) -> tuple[dict, str]:
    """({computation: {instruction: (types, opcode, operands, attributes)}}, the entry's name) of the
    computations that run (a fusion's body is its fusion's)."""
    found, entry, current = {}, None, None
    for line in hlo.splitlines():
        if line.endswith("{") and " = " not in line and line[:1] in "%E":
            name = re.match(r"(?:ENTRY )?%([\w.\-]+)", line).group(1)
            current = None if "fused" in name or "wrapped" in name else found.setdefault(name, {})
            entry = name if line.startswith("ENTRY") else entry
            continue
        match = _INSTRUCTION.match(re.sub(r"/\*[^*]*\*/", "", line.strip()))
        if current is not None and match:
            name, types, opcode, operands, rest = match.groups()
            names = [o.strip().lstrip("%") for o in operands.split(",") if o.strip().startswith("%")]
            rest = f"parameter({operands}){rest}" if opcode == "parameter" else rest
            current[name] = ([(t, dims_of(d)) for t, d in _ARRAY.findall(types)], opcode, names, rest)
    return found, entry


def _runs(computations: dict, entry: str) -> dict[str, int]:
    """How often each computation runs per run of the program: a while loop's body its known trip
    count times its caller's, a called computation as often as its caller."""
    runs = {entry: 1}
    pending = [entry]
    while pending:
        caller = pending.pop()
        for _, opcode, _, rest in computations[caller].values():
            count = (
                int(re.search(r'known_trip_count":\{"n":"(\d+)"', rest).group(1)) if opcode == "while" else 1
            )
            for callee in re.findall(
                r"(?:to_apply|body|calls|branch_computations=\{[^}]*)=?%([\w.\-]+)", rest
            ):
                if callee in computations and callee not in runs:
                    runs[callee] = runs[caller] * count
                    pending.append(callee)
    return runs


def block_scaled_weight_copies(hlo: str) -> dict[str, float]:
    """Bytes written per run of an optimised HLO module in making the weight operands (values and block
    scales: right-hand operand and its scales) of its cuDNN block-scaled GEMMs: {"values", "scales"}
    the arrays written from the stored weight before the GEMM's call (copied, sliced or deinterleaved,
    in any narrow type: u8, float8, E2M1), "swizzle" XLA's own transposes of the weight's scales to
    cuDNN's tiled layout inside the call."""
    computations, entry = _computations(hlo)
    runs = _runs(computations, entry)
    copied = {"values": 0.0, "scales": 0.0, "swizzle": 0.0}
    gemms = {
        name
        for name, body in computations.items()
        if any('"__cudnn$blockScaledDot"' in rest for _, _, _, rest in body.values())
    }
    called = set()
    for caller, body in computations.items():
        for _, opcode, operands, rest in body.values():
            callee = re.search(r"to_apply=%([\w.\-]+)", rest)
            if opcode != "call" or callee is None or callee.group(1) not in gemms:
                continue
            called.add(callee.group(1))
            for operand, kind in ((operands[1], "values"), (operands[3], "scales")):
                copied[kind] += _written(body, operand) * runs.get(caller, 0)
            copied["swizzle"] += _swizzled(computations[callee.group(1)]) * runs.get(caller, 0)
    if called != gemms:  # a GEMM XLA no longer wraps in a call of its own: this reading would miss it
        raise ValueError(f"block-scaled GEMMs outside a call: {sorted(gemms - called)}")
    return copied


def _written(body: dict, name: str, index: int | None = None) -> float:
    """Bytes of narrow arrays written by the chain of operations that makes `name` (element `index` of a
    tuple) from what the computation was given."""
    types, opcode, operands, rest = body[name]
    if opcode == "get-tuple-element":
        return _written(body, operands[0], int(re.search(r"index=(\d+)", rest).group(1)))
    if opcode in ("parameter", "constant"):
        return 0.0
    kept = types if index is None else [types[index]]
    narrow = [(t, d) for t, d in kept if t in _NARROW]
    if not narrow:
        return 0.0
    own = 0.0 if opcode == "bitcast" else sum(_NARROW[t] * math.prod(d) for t, d in narrow)
    return own + sum(_written(body, o) for o in operands if o in body and body[o][1] != "parameter")


def _swizzled(gemm: dict) -> float:
    """Bytes the GEMM's own computation writes from its fourth parameter (the right-hand scales) before
    the custom call: XLA's swizzle to cuDNN's tiled layout."""
    (scales,) = [n for n, (_, op, _, rest) in gemm.items() if op == "parameter" and "parameter(3)" in rest]
    (call,) = [v for v in gemm.values() if '"__cudnn$blockScaledDot"' in v[3]]
    written = _written(gemm, call[2][3])
    return written if _reaches(gemm, call[2][3], scales) else 0.0


def _reaches(body: dict, name: str, target: str) -> bool:
    """Whether `name` is made from `target`."""
    if name == target:
        return True
    return name in body and any(_reaches(body, o, target) for o in body[name][2])
