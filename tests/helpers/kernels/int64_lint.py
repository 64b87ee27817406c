"""Lint: a runtime stride in a Triton kernel is multiplied only by an int64 value or a compile-time constant.

Triton passes an integer argument that fits in 32 bits as i32, and ``tl.program_id``, ``tl.arange``
and loop counters are i32 too, so ``row * stride`` wraps once it passes 2**31 elements: Kimi K3's
AttnRes snapshot buffer [blocks, T, 7168] does at block 8 of a 37K-token step. The rule checked in
every ``@triton.jit`` function under ``kernels/``:

- a *runtime stride* is a parameter whose name contains ``stride`` and which is not annotated
  ``tl.constexpr``;
- every ``a * b`` where one side mentions a runtime stride must have an int64 operand: an
  expression holding ``.to(tl.int64)`` / ``tl.cast(..., tl.int64)`` / ``tl.zeros(..., tl.int64)``
  or a name assigned from one
  (names are followed in source order, so ``t = tl.program_id(0).to(tl.int64)`` makes ``t`` and
  ``t * K + j`` int64); or the other side is the same in every program and bounded at compile
  time: literals, ``tl.constexpr`` parameters, ``tl.arange`` over them and names bound to such
  (a constant step such as ``BLOCK_K * stride_k``, a tile's lane offsets ``tl.arange(0, BLOCK)``).
  Anything built from ``tl.program_id``, a loaded value, a loop counter or a helper's parameter is
  program-dependent and needs the cast.

Run as ``python -m tests.helpers.kernels.int64_lint [dir]`` to print the offending lines of a tree (an
older checkout's ``kernels/`` for instance); exit status 1 when there are any.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    function: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.function}: {self.text}"


def _is_jit(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
        if isinstance(target, ast.Name) and target.id == "jit":
            return True
    return False


def _is_constexpr(arg: ast.arg) -> bool:
    return arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation)


def _is_int64_dtype(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return text in ("tl.int64", "tl.uint64", "triton.language.int64")


def _casts_to_int64(node: ast.AST) -> bool:
    # x.to(tl.int64), tl.cast(x, tl.int64), tl.zeros(shape, dtype=tl.int64), tl.full(..., tl.int64)
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Call):
            continue
        func = sub.func
        if isinstance(func, ast.Attribute) and func.attr in ("to", "cast", "zeros", "full"):
            args = list(sub.args) + [kw.value for kw in sub.keywords if kw.arg in ("dtype",)]
            if any(_is_int64_dtype(a) for a in args):
                return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _FunctionLint(ast.NodeVisitor):
    def __init__(self, fn: ast.FunctionDef, path: str, source: str):
        self.path, self.source, self.fn = path, source, fn
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        self.constexpr = {a.arg for a in args if _is_constexpr(a)}
        self.strides = {a.arg for a in args if "stride" in a.arg.lower() and a.arg not in self.constexpr}
        self.int64: set[str] = set()
        self.bounded: set[str] = set()
        self.findings: list[Finding] = []

    # -- what counts as int64 or constant

    def _int64(self, node: ast.AST) -> bool:
        return _casts_to_int64(node) or bool(_names(node) & self.int64)

    def _constant(self, node: ast.AST) -> bool:
        # literals, constexpr parameters and tl.arange over them (and names bound to such): values
        # that are the same in every program and bounded by the kernel's compile-time sizes
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and ast.unparse(sub.func) not in ("tl.arange", "tl.full", "tl.zeros"):
                return False
        names = _names(node) - {"tl", "None"}
        return names <= self.constexpr | self.bounded

    def _mentions_stride(self, node: ast.AST) -> bool:
        return bool(_names(node) & self.strides)

    # -- statements, in source order

    def _assign(self, targets: list[ast.AST], value: ast.AST) -> None:
        self.visit(value)
        for target in targets:
            for name in _names(target):
                if self._int64(value):
                    self.int64.add(name)
                else:
                    self.int64.discard(name)
                if self._constant(value):
                    self.bounded.add(name)
                else:
                    self.bounded.discard(name)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assign(node.targets, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.op, ast.Mult):
            self._check(node, node.target, node.value)
        if isinstance(node.target, ast.Name):
            if self._int64(node.value):
                self.int64.add(node.target.id)
            if not self._constant(node.value):
                self.bounded.discard(node.target.id)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._assign([node.target], node.value)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        for name in _names(node.target):
            self.int64.discard(name)
            self.bounded.discard(name)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self.generic_visit(node)
        if isinstance(node.op, ast.Mult):
            self._check(node, node.left, node.right)

    def _check(self, node: ast.AST, left: ast.AST, right: ast.AST) -> None:
        l_stride, r_stride = self._mentions_stride(left), self._mentions_stride(right)
        if not (l_stride or r_stride) or self._int64(left) or self._int64(right):
            return
        if (l_stride and not r_stride and self._constant(right)) or (
            r_stride and not l_stride and self._constant(left)
        ):
            return
        line = self.source.splitlines()[node.lineno - 1].strip()
        self.findings.append(Finding(self.path, node.lineno, self.fn.name, line))


def lint_source(source: str, path: str = "<source>") -> list[Finding]:
    """The multiplications of a runtime stride without an int64 operand in ``source``'s Triton kernels."""
    tree = ast.parse(source)
    findings: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and _is_jit(node):
            lint = _FunctionLint(node, path, source)
            for stmt in node.body:
                lint.visit(stmt)
            findings.extend(lint.findings)
    return sorted(set(findings), key=lambda f: (f.path, f.line))


def lint_tree(root: Path) -> list[Finding]:
    findings: list[Finding] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "triton.jit" in text:
            findings.extend(lint_source(text, str(path)))
    return findings


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[3] / "kernels"
    findings = lint_tree(root)
    for f in findings:
        print(f)
    print(f"{len(findings)} multiplication(s) of a runtime stride without an int64 operand under {root}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
