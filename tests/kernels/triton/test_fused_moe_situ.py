"""The fused MoE kernels with SiTU vs the PyTorch reference on CPU via TRITON_INTERPRET=1, in one
child process (``tests/kernels/triton/fused_moe_situ_cases.py``); each case reports as its own test."""

import pytest

from tests.helpers.interpret import needs_triton, run_interpreted
from tests.kernels.triton.fused_moe_situ_cases import CASES

pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.fused_moe_situ_cases")


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_moe_situ_matches_reference(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    assert result == "ok", result
