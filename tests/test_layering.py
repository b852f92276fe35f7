"""The house's layering, as each package's docstring states it: who may import whom, and no circles.

Reads every module's imports (those inside functions too) from its source; nothing is imported."""

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src"
FRONT_ENDS = ("klein.cli", "klein.serve", "klein.batch", "klein.bench")
SHARED = (
    "klein.images",
    "klein.masks",
    "klein.sampling",
    "klein.sharding",
    "klein.dtypes",
    "klein.errors",
    "klein.version",
    "klein.ray_runtime",
)

# Package -> what its modules must not import (prefixes of module names).
FORBIDDEN = {
    "klein.models": (
        "klein.io",
        "klein.request",
        "klein.memory",
        "klein.pipeline",
        "klein.lora",
        *FRONT_ENDS,
    ),
    "klein.io": ("klein.memory", "klein.pipeline", *FRONT_ENDS),
    "klein.request": ("klein.io", "klein.memory", "klein.pipeline", *FRONT_ENDS),
    "klein.lora": ("klein.memory", "klein.pipeline", *FRONT_ENDS),
    "klein.memory": ("klein.pipeline", *FRONT_ENDS),
    "klein.pipeline": FRONT_ENDS,
    "klein.serve": ("klein.cli", "klein.batch", "klein.bench"),
    "klein.batch": ("klein.cli", "klein.serve", "klein.bench"),
    "klein.bench": ("klein.cli", "klein.serve", "klein.batch"),
    "klein.cli": ("klein.serve", "klein.batch"),
    **{shared: ("klein.memory", "klein.pipeline", *FRONT_ENDS) for shared in SHARED},
}
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


MODULES = {module_name(path): path for path in sorted((SOURCE / "klein").rglob("*.py"))}
GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(graph: dict[str, set[str]], package: str) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _under(module, package)
        for target in sorted(targets)
        if any(_under(target, forbidden) for forbidden in FORBIDDEN[package])
        and (module, target) not in ALLOWED
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_package_imports_only_what_its_layer_allows(package):
    broken = violations(GRAPH, package)
    assert not broken, "\n".join(broken)


def test_models_import_nothing_but_models_sharding_and_errors():
    broken = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _under(module, "klein.models")
        for target in targets
        if target != "klein" and not any(_under(target, allowed) for allowed in MODELS_MAY_IMPORT)
    ]
    assert not broken, "\n".join(broken)


def test_no_module_imports_itself_back():
    """No circle of imports between klein's modules (a package's `__init__` counts as a module)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH.get(name, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target in GRAPH and target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in GRAPH:
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(circles)


def test_the_checks_see_imports_inside_functions_and_a_forbidden_one():
    """The reader finds a lazy import (the command line loads the pipeline inside a function), and the
    check flags what the server once did: take its PNG writer from the command line."""
    assert "klein.pipeline.loading" in GRAPH["klein.cli.main"]
    planted = dict(
        GRAPH, **{"klein.serve.generation": GRAPH["klein.serve.generation"] | {"klein.cli.output"}}
    )
    assert violations(planted, "klein.serve") == ["klein.serve.generation imports klein.cli.output"]
