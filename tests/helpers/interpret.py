"""Shared plumbing for the Triton-interpreter test files (``test_triton_interpret`` with its child
``interpret_cases``, ``fused_moe_situ_cases``, ``test_fused_small_ops`` and
``test_launch_fusions``).

Each such file registers its cases with ``case``, runs them all once in a fresh child process with
``TRITON_INTERPRET=1`` (the interpreter is chosen when ``@triton.jit`` runs, so the variable must be
set before any kernel module is imported, and setting it inside the pytest process would leak into
GPU tests), and reports each case as its own pytest test. This module imports no kernel module.
"""

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# The pytest side of each file: ``pytestmark = needs_triton`` (skips cleanly without triton).
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def case_registry() -> tuple[dict[str, Callable], Callable]:
    """A fresh ``{name: fn}`` table and the decorator that files a function in it under its name."""
    cases: dict[str, Callable] = {}

    def case(fn):
        cases[fn.__name__] = fn
        return fn

    return cases, case


def close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Compare in fp32 with one tolerance for rtol and atol (fp16 outputs vs fp32 references)."""
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


def run_interpreted(module: str, *cases: str) -> dict[str, str]:
    """Run ``python -m module [case ...]`` under the interpreter (all its cases when none are named);
    its last stdout line is the JSON ``{case name: "ok" | "ok: note" | traceback}``. Fails the
    calling test when the child fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "KIMITUI_KERNELS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", module, *cases],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreter child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def child_main(cases: dict[str, Callable]) -> None:
    """The child's side of ``run_interpreted``: run the named cases (all when none are named on the
    command line), print ``{case name: "ok" | "ok: note" | traceback}`` as one JSON line, exit 0."""
    torch.manual_seed(0)
    results = {}
    for name in sys.argv[1:] or list(cases):
        try:
            note = cases[name]()
            results[name] = "ok" if note is None else f"ok: {note}"
        except Exception:
            results[name] = traceback.format_exc(limit=6)
    print(json.dumps(results))
    sys.exit(0)
