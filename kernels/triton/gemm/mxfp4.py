"""MXFP4 GEMM: bf16/fp16 activations times OCP MXFP4 weights, dequantised in-kernel with bit maths.

Weight layout (OCP Microscaling Formats v1.0, see ``kernels.reference``): ``packed`` uint8 [N, K/2], low nibble = even column;
``scale`` uint8 [N, K/32] E8M0 exponents. Decoding by hand instead of ``tl.dot_scaled`` keeps one
code path for the interpreter, Hopper (no FP4 units) and CDNA3. Reference: ``reference.linear_mxfp4``.
"""

import torch
import triton
import triton.language as tl

from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device, interpreting

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
def _mxfp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # [BM, BK]
        mask_w = mask_k[:, None] & mask_n[None, :]
        byte = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 2) * stride_wk,
            mask=mask_w, other=0,
        ).to(tl.int32)  # [BK, BN]
        code = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF  # even k in the low nibble
        s = tl.load(
            s_ptr + offs_n[None, :] * stride_sn + (offs_k[:, None] // 32) * stride_sk,
            mask=mask_w, other=127,
        ).to(tl.int32)  # [BK, BN] E8M0
        scale = tl.where(s == 255, float("nan"), tl.exp2((s - 127).to(tl.float32)))
        w = (_e2m1_to_float(code) * scale).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )




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

    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _mxfp4_gemm_kernel[grid](
        x, packed, scale, out, m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1),
        scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
