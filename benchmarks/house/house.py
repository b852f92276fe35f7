"""The house's shape, in numbers: lines of src, the largest file and the longest function, the imports that run
from a lower package to a higher one (in tests/test_layering.py's ORDER), and the walk of one setting of
`klein generate` from the command line to the model.

The walk: from `klein.cli.main`, follow imports into the modules whose source names the setting (as a word),
and count the modules reached and, among the imports walked, those from the planner (`klein.memory`) to
`klein.io` (the planner reading a file's header for what the loader reads too) and those that go up the order.
Reads sources only; nothing of klein is imported.

Run: python benchmarks/house/house.py [--setting NAME ...]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src"
sys.path.insert(0, str(ROOT))
from tests import test_layering as layering  # noqa: E402


def longest_function() -> tuple[int, str]:
    best = (0, "")
    for name, path in layering.MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                best = max(best, (node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
    return best


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def level(module: str) -> int | None:
    order = getattr(layering, "ORDER", None)
    if order is None:
        return None
    for rank, packages in enumerate(order):
        if package(module) in (packages if isinstance(packages, tuple) else (packages,)):
            return rank
    return None


def upward(edges) -> list[tuple[str, str]]:
    return [
        (a, b)
        for a, b in edges
        if package(a) != package(b) and level(a) is not None and level(b) is not None and level(b) > level(a)
    ]


def walk(setting: str) -> tuple[set[str], list[tuple[str, str]]]:
    word = re.compile(rf"\b{re.escape(setting)}\b")
    mentions = {name for name, path in layering.MODULES.items() if word.search(path.read_text())}
    seen, edges, queue = {"klein.cli.main"}, [], deque(["klein.cli.main"])
    while queue:
        module = queue.popleft()
        for target in sorted(layering.GRAPH[module]):
            if target in mentions:
                edges.append((module, target))
                if target not in seen:
                    seen.add(target)
                    queue.append(target)
    return seen, edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", nargs="*", default=["compute", "guidance_scale", "residency"])
    args = parser.parse_args()
    sizes = {name: len(path.read_text().splitlines()) for name, path in layering.MODULES.items()}
    largest = max(sizes, key=sizes.get)
    length, function = longest_function()
    all_edges = [(a, b) for a, targets in layering.GRAPH.items() for b in targets]
    print(f"src: {sum(sizes.values())} lines in {len(sizes)} modules")
    print(f"largest file: {largest} ({sizes[largest]} lines)")
    print(f"longest function: {function} ({length} lines)")
    up = upward(all_edges)
    print(
        f"imports from a lower package to a higher one: {len(up)}"
        + ("" if level("klein.cli") else " (no ORDER)")
    )
    for a, b in up:
        print(f"  {a} -> {b}")
    planner_io = [(a, b) for a, b in all_edges if package(a) == "klein.memory" and package(b) == "klein.io"]
    print(f"planner imports of io modules: {len(planner_io)}")
    for setting in args.setting:
        modules, edges = walk(setting)
        back = [(a, b) for a, b in edges if package(a) == "klein.memory" and package(b) == "klein.io"]
        print(
            f"setting {setting!r}: {len(modules)} modules from the command line, {len(edges)} imports walked, "
            f"{len(back)} from the planner to io, {len(upward(edges))} up the order"
        )


if __name__ == "__main__":
    main()
