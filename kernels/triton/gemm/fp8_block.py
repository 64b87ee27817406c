"""Block-FP8 weight GEMM: bf16/fp16 activations times e4m3fn weights with 2-D block scales.

Weight layout (DeepSeek-V3 block FP8, see ``kernels.reference``): ``w`` float8_e4m3fn [N, K], ``scale_inv`` fp32
[ceil(N/bn), ceil(K/bk)], ``W = w * scale_inv[n // bn, k // bk]``. The weight is upcast in-kernel
and multiplied in the activation dtype (DeepSeek's ``gemm_impl="bf16"`` path); activations are not
quantised. fp8 loads work under TRITON_INTERPRET=1 (the interpreter upcasts them exactly; tests/kernels runs them there).
Reference: ``reference.linear_fp8_block``.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device
from kimitui.kernels.triton.split_k import finish, outputs, plan_gemm


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    STEPS,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_os,
    stride_om,
    stride_on,
    QBLOCK_N: tl.constexpr,
    QBLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program (m, n, s): output tile (m, n), K-steps [s * STEPS, (s + 1) * STEPS).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_begin = pid_k * STEPS * BLOCK_K
    k_end = tl.minimum(k_begin + STEPS * BLOCK_K, K)
    lanes_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_begin + lanes_k).to(tl.int64)[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_begin + lanes_k).to(tl.int64)[:, None] * stride_wk
    s_cols = s_ptr + (offs_n[None, :] // QBLOCK_N) * stride_sn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + lanes_k
        mask_k = offs_k < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        mask_w = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_ptrs, mask=mask_w, other=0.0).to(tl.float32)  # [BK, BN]
        if QBLOCK_K % BLOCK_K == 0:  # the tile lies in one quant block along K: one scale per column
            kb = ((k0 + tl.zeros((1,), dtype=tl.int32)) // QBLOCK_K).to(tl.int64)  # [1]
            s = tl.load(s_cols + kb[:, None] * stride_sk, mask=mask_n[None, :], other=0.0)  # [1, BN]
        else:  # tiles need not align with quant blocks: the scale is gathered per element
            s = tl.load(s_cols + (offs_k // QBLOCK_K).to(tl.int64)[:, None] * stride_sk, mask=mask_w, other=0.0)
        acc = tl.dot(x, (w * s).to(x.dtype), acc, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    # SPLIT: the fp32 partial of this K range, summed by split_k's reduce kernel
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc if SPLIT else acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_block_gemm(
    x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``x [M, K] @ dequant_fp8_block(w_fp8, scale_inv, block).T -> [M, N]`` in x.dtype.

    ``w_fp8`` float8_e4m3fn [N, K], ``scale_inv`` fp32 [ceil(N/bn), ceil(K/bk)].
    """
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.dim() != 2 or w_fp8.shape[1] != k:
        raise ValueError(f"w_fp8 must be float8_e4m3fn [N, K={k}], got {tuple(w_fp8.shape)} {w_fp8.dtype}")
    n = w_fp8.shape[0]
    bn, bk = block
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be positive, got {block}")
    expected = (-(-n // bn), -(-k // bk))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv must be fp32 {list(expected)}, got {tuple(scale_inv.shape)} {scale_inv.dtype}")
    if not (w_fp8.is_contiguous() and scale_inv.is_contiguous()):
        raise ValueError("w_fp8 and scale_inv must be contiguous")
    check_device(x, w_fp8, scale_inv)

    plan = plan_gemm(m, n, k)
    out, target = outputs(plan, x.dtype, x.device)
    split = plan.split > 1
    _fp8_block_gemm_kernel[plan.grid](
        x,
        w_fp8,
        scale_inv,
        target,
        m,
        n,
        k,
        plan.steps_per_split,
        x.stride(0),
        x.stride(1),
        w_fp8.stride(0),
        w_fp8.stride(1),
        scale_inv.stride(0),
        scale_inv.stride(1),
        target.stride(0) if split else 0,
        target.stride(-2),
        target.stride(-1),
        QBLOCK_N=bn,
        QBLOCK_K=bk,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        SPLIT=split,
    )
    return finish(plan, out, target)
