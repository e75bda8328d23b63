"""Dependencies between the top-level packages run one way (DESIGN.md "Principles"):

    pallas_kernels -> none of ours
    sharding       -> pallas_kernels
    model          -> pallas_kernels, sharding
    sampling       -> model, sharding, pallas_kernels
    experiments    -> anything

Every .py file of those packages is parsed with `ast`; every import counts, at module level or inside a
function, and relative imports are resolved against the file's own package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("model", "sharding", "sampling", "pallas_kernels", "experiments")
ALLOWED = {
    "pallas_kernels": set(),
    "sharding": {"pallas_kernels"},
    "model": {"pallas_kernels", "sharding"},
    "sampling": {"model", "sharding", "pallas_kernels"},
    "experiments": set(OURS) - {"experiments"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at `path` (relative ones resolved)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)
    package = package[:-1]  # the package a module (or __init__) belongs to
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.append((node.lineno, name))
    return out


def package_imports() -> dict[str, dict[str, list[str]]]:
    """{package: {imported package of ours: ["file:line", ...]}} over every file of OURS."""
    edges: dict[str, dict[str, list[str]]] = {p: {} for p in OURS}
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, name in imported_modules(path):
                target = name.split(".")[0]
                if target in OURS and target != top:
                    edges[top].setdefault(target, []).append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def test_relative_imports_resolve():
    names = {name for _, name in imported_modules(ROOT / "model" / "sharded.py")}
    assert {"model.transformer", "model.cache", "sharding.rules"} <= names   # `from .transformer import ...`
    names = {name for _, name in imported_modules(ROOT / "sharding" / "__init__.py")}
    assert "sharding.expert_parallel" in names                                # a package's own __init__


@pytest.mark.parametrize("package", OURS)
def test_allowed_directions(package):
    bad = {target: where for target, where in package_imports()[package].items() if target not in ALLOWED[package]}
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}; it imports " + "; ".join(
        f"{target} at {', '.join(where)}" for target, where in sorted(bad.items()))


def test_no_cycle_between_packages():
    edges = {p: set(targets) for p, targets in package_imports().items()}
    state: dict[str, str] = {}

    def visit(p: str, trail: list[str]) -> None:
        state[p] = "open"
        for q in sorted(edges[p]):
            if state.get(q) == "open":   # q is on the current trail
                cycle = trail[trail.index(q):] + [q]
                raise AssertionError(f"import cycle between packages: {' -> '.join(cycle)}")
            if q not in state:
                visit(q, trail + [q])
        state[p] = "done"

    for p in OURS:
        if p not in state:
            visit(p, [p])
