"""The package's layers hold: no import circle, and no module imports from a layer above its own.

`LAYERS` is the drawing in docs/design.md ("Layers") as data, bottom to top. Groups on the same
rank are siblings: neither imports the other (the front ends and codegen both build on the IR and
know nothing of each other). A module that matches no pattern fails the test, so a new module is
placed in a layer on purpose.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flexattn"

# (rank, group, module patterns); a module may import its own group and any group of a lower rank.
LAYERS = [
    (0, "support", ["flexattn.version", "flexattn.lru"]),
    (1, "IR", ["flexattn.ir", "flexattn.mods", "flexattn.autodiff", "flexattn.interval"]),
    (2, "front ends", ["flexattn.torch_functions", "flexattn.tracer", "flexattn.dsl", "flexattn.dsl.*"]),
    (2, "codegen", ["flexattn.codegen", "flexattn.codegen.*"]),
    (3, "kernels", ["flexattn.kernels", "flexattn.kernels.*"]),
    (4, "call path", ["flexattn.scalars", "flexattn.modcache", "flexattn.capture", "flexattn.reference",
                      "flexattn.masks", "flexattn.scores", "flexattn.block_mask", "flexattn.block_mask.*",
                      "flexattn.viz", "flexattn.ops", "flexattn.call", "flexattn.auxiliary",
                      "flexattn.attention", "flexattn.decode", "flexattn.paged", "flexattn.varlen"]),
    (5, "package", ["flexattn", "flexattn.distributed", "flexattn.distributed.*", "flexattn.integrations",
                    "flexattn.integrations.*", "flexattn.cli", "flexattn.__main__", "flexattn.demo"]),
]


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (kernel templates are source text, not modules)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "templates" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def absolute(node: ast.ImportFrom, name: str, path: Path) -> str | None:
    """The dotted module a ``from ... import`` names, relative ones (``from .ir import``,
    ``from . import ir``) resolved against ``name``, the importing module."""
    if not node.level:
        return node.module
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, known: dict, name: str) -> set[str]:
    """The package modules ``path`` (module ``name``) imports, at any depth of the file
    (function-local ones too), relative imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        module = absolute(node, name, path) if isinstance(node, ast.ImportFrom) else None
        if module and module.split(".")[0] == "flexattn":
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "flexattn"}
    return found


def layer_of(name: str) -> tuple[int, str]:
    for rank, group, patterns in LAYERS:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return rank, group
    raise AssertionError(f"{name} is in no layer: place it in LAYERS (and in docs/design.md's drawing)")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known, name) - {name} for name, path in known.items()}


def test_every_module_has_a_layer():
    for name in graph():
        layer_of(name)


def test_no_module_imports_from_a_higher_layer_or_a_sibling():
    wrong = []
    for name, deps in graph().items():
        rank, group = layer_of(name)
        for dep in deps:
            dep_rank, dep_group = layer_of(dep)
            if dep_group != group and dep_rank >= rank:
                wrong.append(f"{name} ({group}) imports {dep} ({dep_group})")
    assert not wrong, "\n".join(sorted(wrong))


def test_relative_imports_are_resolved():
    """``from .x import y`` counts like ``from flexattn.<package>.x import y``: the layer rules
    cannot be stepped around by spelling an import relatively."""
    module, package = PACKAGE / "kernels" / "launch.py", PACKAGE / "kernels" / "__init__.py"
    cases = [("from .plans import Plan", module, "flexattn.kernels.plans"),
             ("from . import plans", module, "flexattn.kernels"),
             ("from ..attention import flex_attention", module, "flexattn.attention"),
             ("from .plans import Plan", package, "flexattn.kernels.plans"),
             ("from flexattn.ir import Node", module, "flexattn.ir")]
    for source, path, expected in cases:
        name = "flexattn.kernels" if path.name == "__init__.py" else "flexattn.kernels.launch"
        assert absolute(ast.parse(source).body[0], name, path) == expected, source


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(g.get(name, ())):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(g):
        if name not in state:
            visit(name)
