"""MXFP4 GEMM: bf16/fp16 activations times OCP MXFP4 weights, dequantised in-kernel with bit maths.

Weight layout (OCP Microscaling Formats v1.0, see ``kernels.reference``): ``packed`` uint8 [N, K/2], low nibble = even column;
``scale`` uint8 [N, K/32] E8M0 exponents. Decoding by hand instead of ``tl.dot_scaled`` keeps one
code path for the interpreter, Hopper (no FP4 units) and CDNA3. Reference: ``reference.linear_mxfp4``.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device
from kimitui.kernels.triton.split_k import finish, outputs, plan_gemm

MXFP4_BLOCK = 32


@triton.jit
def _e2m1_to_float(code):
    # code: int32 in [0, 16). Bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
    exp = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    subnormal = man * 0.5
    normal = (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32))
    mag = tl.where(exp == 0, subnormal, normal)
    return tl.where((code >> 3) != 0, -mag, mag)


@triton.jit
def _mxfp4_tile(byte, e, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # byte [BK/2, BN] and E8M0 exponents e [BK/32, BN] (int32), each loaded once -> the fp32 weights
    # [BK, BN]: row k of the tile is byte k // 2 (even k in the low nibble), exponent k // 32
    code = (byte[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 0xF  # [BK/2, 2, BN]
    code = tl.reshape(code, (BLOCK_K, BLOCK_N))
    scale = tl.where(e == 255, float("nan"), tl.exp2((e - 127).to(tl.float32)))
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
    return _e2m1_to_float(code) * scale


@triton.jit
def _mxfp4_gemm_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program (m, n, s): output tile (m, n), K-steps [s * STEPS, (s + 1) * STEPS). Each byte is
    # loaded once per tile ([BK/2, BN]) and both its nibbles decoded in registers; each E8M0 scale
    # once per 32 columns ([BK/32, BN]).
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
    lanes_b = tl.arange(0, BLOCK_K // 2)
    lanes_s = tl.arange(0, BLOCK_K // 32)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_begin + lanes_k).to(tl.int64)[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_begin // 2 + lanes_b).to(tl.int64)[:, None] * stride_wk
    s_ptrs = s_ptr + offs_n[None, :] * stride_sn + (k_begin // 32 + lanes_s).to(tl.int64)[:, None] * stride_sk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None] & ((k0 + lanes_k) < K)[None, :], other=0.0)  # [BM, BK]
        byte = tl.load(w_ptrs, mask=((k0 // 2 + lanes_b) < K // 2)[:, None] & mask_n[None, :], other=0).to(
            tl.int32
        )  # [BK/2, BN]
        e = tl.load(s_ptrs, mask=((k0 // 32 + lanes_s) < K // 32)[:, None] & mask_n[None, :], other=127).to(
            tl.int32
        )  # [BK/32, BN] E8M0
        w = _mxfp4_tile(byte, e, BLOCK_K, BLOCK_N).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += (BLOCK_K // 2) * stride_wk
        s_ptrs += (BLOCK_K // 32) * stride_sk
    # SPLIT: the fp32 partial of this K range, summed by split_k's reduce kernel
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc if SPLIT else acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def mxfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant_mxfp4(packed, scale).T -> [M, N]`` in x.dtype.

    ``packed`` uint8 [N, K/2], ``scale`` uint8 [N, K/32]; K must be a multiple of 32.
    """
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs K to be a multiple of {MXFP4_BLOCK}, got K={k}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != k // 2:
        raise ValueError(f"packed must be uint8 [N, K/2={k // 2}], got {tuple(packed.shape)} {packed.dtype}")
    n = packed.shape[0]
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (n, k // MXFP4_BLOCK):
        raise ValueError(
            f"scale must be uint8 [N={n}, K/32={k // MXFP4_BLOCK}], got {tuple(scale.shape)} {scale.dtype}"
        )
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("packed and scale must be contiguous")
    check_device(x, packed, scale)

    plan = plan_gemm(m, n, k)
    out, target = outputs(plan, x.dtype, x.device)
    split = plan.split > 1
    _mxfp4_gemm_kernel[plan.grid](
        x,
        packed,
        scale,
        target,
        m,
        n,
        k,
        plan.steps_per_split,
        x.stride(0),
        x.stride(1),
        packed.stride(0),
        packed.stride(1),
        scale.stride(0),
        scale.stride(1),
        target.stride(0) if split else 0,
        target.stride(-2),
        target.stride(-1),
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        SPLIT=split,
    )
    return finish(plan, out, target)
