"""Triton kernels vs reference on CPU via TRITON_INTERPRET=1, in one child process.

The child (``tests/kernels/interpret_cases.py``) runs every case once; each case then reports as
its own test here. Skips cleanly when triton is not installed.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.interpret_cases import CASES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter_results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "KIMITUI_KERNELS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.interpret_cases"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreter child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_matches_reference(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    assert result == "ok", result
