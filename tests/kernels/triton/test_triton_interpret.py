"""Triton kernels vs reference on CPU via TRITON_INTERPRET=1, in one child process.

The child (``tests/kernels/triton/interpret_cases.py``) runs every case once; each case then reports as
its own test here. Skips cleanly when triton is not installed.
"""

import pytest

from tests.helpers.interpret import needs_triton, run_interpreted
from tests.kernels.triton.interpret_cases import CASES

pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.interpret_cases")


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_matches_reference(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    assert result == "ok", result
