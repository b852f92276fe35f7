"""Reading optimised HLO text (a program compiled for a GPU from this machine): the operations of a kind
with their result and operand types, for the GPU compile tests' assertions."""

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
