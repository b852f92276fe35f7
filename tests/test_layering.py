"""The house's layering, as each package's docstring states it: the packages in one order, each importing
only those below it, and no circles.

Reads every module's imports (those inside functions too) from its source; nothing is imported."""

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src"

ORDER = (
    ("klein.errors",),
    ("klein.version", "klein.dtypes", "klein.devices"),
    ("klein.sharding",),
    ("klein.models",),
    ("klein.io",),
    ("klein.lora",),
    ("klein.memory",),
    ("klein.request",),
    ("klein.images", "klein.sampling"),
    ("klein.masks",),
    ("klein.pipeline",),
    ("klein.aot", "klein.ray_runtime"),
    ("klein.serve", "klein.batch", "klein.bench"),
    ("klein.cli",),
    ("klein",),
)
"""The packages from the bottom up (a top-level module is a package of its own; `klein` itself is the
public namespace, which names the pipeline lazily): each may import only the levels below its own, never a
sibling at its level nor anything above it."""
LEVEL = {package: level for level, packages in enumerate(ORDER) for package in packages}

# `klein serve` and `klein batch` are commands of the command line: each one's module maps the flags onto
# its front end's options and starts it; nothing else of the command line touches them.
ALLOWED = {
    ("klein.cli.serve", "klein.serve.options"),
    ("klein.cli.serve", "klein.serve.security"),
    ("klein.cli.serve", "klein.serve.server"),
    ("klein.cli.serve", "klein.serve.replicas.cluster"),
    ("klein.cli.batch", "klein.batch.job"),
    ("klein.cli.batch", "klein.batch.local"),
    ("klein.cli.batch", "klein.batch.ray_data"),
}
STARTED = ("klein.serve", "klein.batch")
"""The front ends the command line starts, through `ALLOWED` alone."""
# Models may read nothing and know no request: only these of klein.
MODELS_MAY_IMPORT = ("klein.models", "klein.sharding", "klein.errors")


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The klein modules `path` imports ("from klein.x import y" counts as klein.x.y when y is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
    return {name for name in found if name == "klein" or name.startswith("klein.")}


def package(module: str) -> str:
    """The package `module` belongs to: klein.memory.plan -> klein.memory, klein.images -> klein.images."""
    return ".".join(module.split(".")[:2])


MODULES = {module_name(path): path for path in sorted((SOURCE / "klein").rglob("*.py"))}
GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}
PACKAGES = sorted({package(name) for name in MODULES})


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(graph: dict[str, set[str]], of: str) -> list[str]:
    """Each import by a module of the package `of` of a package at its level or above."""
    return [
        f"{module} imports {target} ({package(target)} is {_where(package(target), of)} {of})"
        for module, targets in graph.items()
        if package(module) == of
        for target in sorted(targets)
        if package(target) != of and LEVEL.get(package(target), len(ORDER)) >= LEVEL[of]
    ]


def _where(target: str, of: str) -> str:
    return "beside" if LEVEL.get(target) == LEVEL[of] else "above"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for module, targets in graph.items():
        found.setdefault(package(module), set()).update(package(t) for t in targets)
    return {name: targets - {name} for name, targets in found.items()}


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle of `graph` found by a depth-first walk, as "a -> b -> a"."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    found = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                found.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target in graph and target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    return found


def test_every_package_has_its_level():
    assert [name for name in PACKAGES if name not in LEVEL] == []


@pytest.mark.parametrize("of", PACKAGES)
def test_each_package_imports_only_the_levels_below_it(of):
    broken = violations(GRAPH, of)
    assert not broken, "\n".join(broken)


def test_no_package_imports_itself_back():
    found = circles(package_graph(GRAPH))
    assert not found, "\n".join(found)


def test_no_module_imports_itself_back():
    """No circle of imports between klein's modules (a package's `__init__` counts as a module)."""
    found = circles(GRAPH)
    assert not found, "\n".join(found)


def test_models_import_nothing_but_models_sharding_and_errors():
    broken = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _under(module, "klein.models")
        for target in targets
        if not any(_under(target, allowed) for allowed in MODELS_MAY_IMPORT)
    ]
    assert not broken, "\n".join(broken)


def test_the_command_line_starts_serve_and_batch_through_their_commands_alone():
    broken = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _under(module, "klein.cli")
        for target in sorted(targets)
        if package(target) in STARTED and (module, target) not in ALLOWED
    ]
    assert not broken, "\n".join(broken)


def test_the_checks_see_imports_inside_functions_and_each_wrong_one():
    """The reader finds a lazy import (the command line loads the pipeline inside a function); the checks
    flag what the server once did (take its PNG writer from the command line), a sibling front end, and the
    planner resolving a request (klein.memory.plan once imported klein.request.resolve), with the circle of
    packages that closes."""
    assert "klein.pipeline.loading" in GRAPH["klein.cli.main"]

    def planted(module: str, target: str) -> dict[str, set[str]]:
        return dict(GRAPH, **{module: GRAPH[module] | {target}})

    upward = planted("klein.serve.generation", "klein.cli.output")
    assert violations(upward, "klein.serve") == [
        "klein.serve.generation imports klein.cli.output (klein.cli is above klein.serve)"
    ]
    beside = planted("klein.serve.generation", "klein.batch.outputs")
    assert violations(beside, "klein.serve") == [
        "klein.serve.generation imports klein.batch.outputs (klein.batch is beside klein.serve)"
    ]
    back = planted("klein.memory.plan", "klein.request.resolve")
    assert violations(back, "klein.memory") == [
        "klein.memory.plan imports klein.request.resolve (klein.request is above klein.memory)"
    ]
    assert "klein.memory -> klein.request -> klein.memory" in circles(package_graph(back))
