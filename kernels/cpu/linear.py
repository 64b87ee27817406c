"""Dense linears on a CPU in the shapes CPU BLAS streams fastest (the CPU backend's PyTorch path).

The C++ few-row kernels (``kernels.cpu_few_rows``) take float32 decode shapes when they are built;
``linear_cpu`` is what runs otherwise: prefill rows, other dtypes, or no extension.
"""

import functools

import torch
import torch.nn.functional as F

# CPU BLAS (MKL, measured on 2 cores) streams the fp32 weight of a product with few rows (decode) on
# one core at about half the memory bandwidth, and its cost grows with the row count long before
# the product is compute bound. linear_cpu splits the weight into row blocks of at most
# _CPU_BLOCK_ROWS rows and runs them as one batched product on all threads. For 1-3 rows the weight
# is the left operand (``bmm([c, N/c, K], x.T)``: 2-2.5x faster than F.linear); for 4-64 rows the
# rows are (``bmm(x, [c, K, N/c])``: 15-45% less time than F.linear or the weight-left form at every
# count measured from 4 to 64, LM head included). Past 64 rows both are compute bound. bf16 and
# fp16 go to oneDNN through F.linear, which is already faster than a blocked product, where oneDNN
# has a native bf16 product; elsewhere (AVX2 only) F.linear in bf16 is a slow fallback (3-4x the
# float32 product on the widened weight from 6 rows on, measured on an AVX2 EPYC, 2 threads), so
# bf16 products of _CPU_WIDEN_ROWS rows or more widen the weight to float32 for the call.
_CPU_FEW_ROWS = 3
_CPU_BLOCKED_ROWS = 64
_CPU_BLOCK_ROWS = 1024
_CPU_WIDEN_ROWS = 6


@functools.cache
def onednn_bf16_native() -> bool:
    """Whether PyTorch's oneDNN computes bf16 products natively on this CPU (AVX-512 BW/VL/DQ,
    AVX-NE-CONVERT or AMX); PyTorch's own answer, asked once."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=256)
def _row_blocks(n: int, threads: int) -> int:
    # The fewest blocks, a multiple of the thread count, that split n rows evenly into blocks of at
    # most _CPU_BLOCK_ROWS rows; else the largest even split up to threads (1: no split).
    for c in range(threads, n + 1, threads):
        if n % c == 0 and n // c <= _CPU_BLOCK_ROWS:
            return c
    return next((c for c in range(min(threads, n), 0, -1) if n % c == 0), 1)  # n = 0: a rank with no rows


def linear_cpu(x, w):
    """``x [..., K] @ w [N, K].T -> [..., N]`` (as ``F.linear``) shaped for CPU BLAS.

    For up to _CPU_BLOCKED_ROWS rows of fp32 the weight is split into row blocks run as one batched
    product on all threads (see ``_CPU_FEW_ROWS``); bf16 products of several rows on a CPU without a
    native bf16 product run in float32; other shapes and dtypes go to ``F.linear``.
    """
    n, k = w.shape
    m = x.numel() // k if k else 0
    if w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and m >= _CPU_WIDEN_ROWS and not onednn_bf16_native():
        return F.linear(x.float(), w.float()).to(torch.bfloat16)
    c = _row_blocks(n, torch.get_num_threads())
    if (
        not 0 < m <= _CPU_BLOCKED_ROWS
        or c == 1
        or w.dtype != torch.float32
        or x.dtype != w.dtype
        or not w.is_contiguous()
    ):
        return F.linear(x, w)
    rows = x.reshape(m, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    blocks = w.view(c, n // c, k)
    if m <= _CPU_FEW_ROWS:
        # rows.t() is [K, M] with strides (1, K), which BLAS reads as a transposed operand; a [K, 1]
        # column with strides (1, 1) (a reshaped row) measured 6x slower.
        y = torch.bmm(blocks, rows.t().expand(c, k, m))  # [c, N/c, M]
        y = y.view(n, m).t().contiguous() if m > 1 else y
    else:
        y = torch.bmm(rows.expand(c, m, k), blocks.transpose(1, 2)).transpose(0, 1).reshape(m, n)  # [M, N]
    return y.view(*x.shape[:-1], n)
