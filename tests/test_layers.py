"""The floor plan of ``docs/architecture.md`` holds: every kvrelay module imports only from folders
on lower floors (or its own folder), so nothing imports upward and nothing imports in a circle.

Imports are read from the source (``ast``), including imports inside functions, so a lazy import
cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvrelay

ROOT = Path(kvrelay.__file__).resolve().parent

#: folder (or top-level module) → floor. Must match the table in docs/architecture.md.
FLOORS: dict[str, int] = {
    "_proto": 0, "logging": 0, "_aio": 0, "_grpc": 0, "_jit": 0, "_madvise": 0, "_oom": 0,
    "_text": 0, "_argparse": 0,
    "__init__": 0,
    "contract": 1,
    "hashing": 2, "discovery": 2, "sim": 2,
    "pool": 3, "publication": 3,
    "ingest": 4,
    "relay": 5, "service": 5, "client": 5,
    "mirror": 6,
    "ops": 7,
    "demo": 8,
    "cli": 9,
    "__main__": 10,
}


def _unit(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "kvrelay"
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


MODULES = {_module_name(p) for p in ROOT.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """kvrelay modules imported by ``path`` (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvrelay" or node.module.startswith("kvrelay."):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvrelay.")}
    return out


def test_every_folder_has_a_floor() -> None:
    units = {_unit(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert units <= set(FLOORS), sorted(units - set(FLOORS))


def test_nothing_imports_upward_or_sideways() -> None:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        me = _unit(_module_name(path))
        if me == "__init__" and _module_name(path) == "kvrelay":
            continue
        for dep in sorted(_imports(path)):
            other = _unit(dep)
            if other == me or other == "__init__":
                continue
            if FLOORS[other] >= FLOORS[me]:
                bad.append(f"{_module_name(path)} (floor {FLOORS[me]}) imports {dep} "
                           f"(floor {FLOORS[other]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules() -> None:
    graph = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}
    known = set(graph)
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            dep = dep if dep in known else dep.rsplit(".", 1)[0]
            if dep not in known or dep == node:
                continue
            if state.get(dep) == 1:
                cycle.extend([*stack[stack.index(dep):], dep])
                return True
            if state.get(dep) is None and visit(dep, stack):
                return True
        stack.pop()
        state[node] = 2
        return False

    for mod in sorted(graph):
        if state.get(mod) is None and visit(mod, []):
            break
    assert not cycle, " -> ".join(cycle)
