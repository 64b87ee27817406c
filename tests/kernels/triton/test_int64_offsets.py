"""Every runtime stride in the Triton kernels is multiplied in int64 (tests/helpers/kernels/int64_lint.py).

Triton passes integers that fit in 32 bits as i32 and program ids, aranges and loop counters are
i32, so ``index * stride`` wraps past 2**31 elements: Kimi K3's AttnRes snapshot buffer
[blocks, T, 7168] did at block 8 of a 37K-token step (``i * stride_bn``), and the dense GEMMs'
``offs_m * stride_xm`` do for x past 2**31 elements. The lint walks every ``@triton.jit`` function
under ``kernels/``; on the tree before this fix it reported 42 such products in 10 files
(``python -m tests.helpers.kernels.int64_lint <old kernels dir>``).
"""

from pathlib import Path

import pytest

from tests.helpers.kernels.int64_lint import lint_source, lint_tree

KERNELS = Path(__file__).resolve().parents[3] / "kernels"


def test_kernels_multiply_strides_in_int64():
    findings = lint_tree(KERNELS)
    assert not findings, "runtime strides multiplied without an int64 operand:\n" + "\n".join(map(str, findings))


def test_lint_sees_every_kernel_file():
    jitted = [p for p in KERNELS.rglob("*.py") if "triton.jit" in p.read_text()]
    assert len(jitted) >= 15, jitted  # the lint has something to walk


# The products the lint must catch, as the kernels had them before (attn_res_mix, the dense GEMMs,
# a helper's parameter), and the forms it must accept.
BAD = {
    "loop counter times a stride (attn_res_mix)": """
@triton.jit
def k(blocks_ptr, N, stride_bn, stride_bt, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for i in range(0, N):
        v = tl.load(blocks_ptr + i * stride_bn + t * stride_bt)
""",
    "program-id tile rows times a stride (dense GEMM)": """
@triton.jit
def k(x_ptr, M, stride_xm, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm)
""",
    "a helper's parameter times a stride": """
@triton.jit
def helper(b_ptr, expert, stride_be):
    return tl.load(b_ptr + expert * stride_be)
""",
    "a runtime argument times a stride": """
@triton.jit
def k(blocks_ptr, N, stride_bn):
    tl.store(blocks_ptr + N * stride_bn, 0.0)
""",
    "an int64 cast lost by reassignment": """
@triton.jit
def k(x_ptr, stride_x):
    t = tl.program_id(0).to(tl.int64)
    t = tl.program_id(0)
    tl.load(x_ptr + t * stride_x)
""",
}

GOOD = {
    "cast index": """
@triton.jit
def k(blocks_ptr, N, stride_bn):
    for i in range(0, N):
        tl.load(blocks_ptr + i.to(tl.int64) * stride_bn)
""",
    "int64 name followed through arithmetic": """
@triton.jit
def k(x_ptr, stride_x, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = t * 2 + 1
    tl.load(x_ptr + row * stride_x + tl.arange(0, BLOCK))
""",
    "constexpr step and lane offsets": """
@triton.jit
def k(x_ptr, stride_xk, BLOCK_K: tl.constexpr):
    lanes = tl.arange(0, BLOCK_K)
    ptrs = x_ptr + lanes[None, :] * stride_xk
    ptrs += BLOCK_K * stride_xk
""",
    "a constexpr stride": """
@triton.jit
def k(x_ptr, N, stride_x: tl.constexpr):
    tl.load(x_ptr + N * stride_x)
""",
    "not a kernel": """
def host(x, stride_x, n):
    return n * stride_x
""",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_lint_flags_int32_products(name):
    findings = lint_source(BAD[name])
    assert findings, name


@pytest.mark.parametrize("name", sorted(GOOD))
def test_lint_accepts_int64_and_constant_products(name):
    assert lint_source(GOOD[name]) == [], name
