"""The project's import graph from its source (AST, no imports run): module -> modules it imports, and
where a function body imports something. tests/test_import_layout.py checks both."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# top-level folder -> the package it is installed as (setup.py maps them)
FOLDERS = {"engine": "kimitui.engine", "kernels": "kimitui.kernels", "themes": "kimitui.themes", "kimitui": "kimitui"}


def modules() -> dict[str, Path]:
    """Every module of the distribution, by dotted name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts]) if parts else package] = path
    return found


@dataclass(frozen=True)
class LocalImport:
    module: str
    line: int
    target: str
    text: str


def _targets(node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The project modules one import statement reaches (a name imported from a package counts as its
    submodule when there is one)."""
    out = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
    else:
        return out
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name.startswith("kimitui"):
            out.append(name)
    return out


def graph() -> tuple[dict[str, set[str]], list[LocalImport]]:
    """(module -> project modules imported at module level, imports inside function bodies)."""
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    local: list[LocalImport] = []
    for module, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)

        def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if in_function:
                        names = [a.name for a in child.names]
                        target = child.module if isinstance(child, ast.ImportFrom) else ", ".join(names)
                        local.append(
                            LocalImport(
                                module,
                                child.lineno,
                                target or "",
                                " ".join(line.strip() for line in lines[child.lineno - 1 : child.end_lineno]),
                            )
                        )
                    elif not type_checking:
                        edges[module].update(t for t in _targets(child, known) if t != module)
                    continue
                is_tc = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                fn = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, in_function or fn, type_checking or is_tc)

        visit(tree, False, False)
    return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return out
