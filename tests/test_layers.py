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


def imports(path: Path, known: dict) -> set[str]:
    """The package modules ``path`` imports, at any depth of the file (function-local ones too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flexattn":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
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
    return {name: imports(path, known) - {name} for name, path in known.items()}


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
