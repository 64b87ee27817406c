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

from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device, interpreting


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om, stride_on,
    QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr,
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
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=mask_w, other=0.0
        ).to(tl.float32)  # [BK, BN]
        # Tiles need not align with quant blocks, so the scale is gathered per element.
        s = tl.load(
            s_ptr + (offs_n[None, :] // QBLOCK_N) * stride_sn + (offs_k[:, None] // QBLOCK_K) * stride_sk,
            mask=mask_w, other=0.0,
        )  # [BK, BN] fp32
        acc = tl.dot(x, (w * s).to(x.dtype), acc, input_precision="ieee")
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )




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

    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        x, w_fp8, scale_inv, out, m, n, k,
        x.stride(0), x.stride(1), w_fp8.stride(0), w_fp8.stride(1),
        scale_inv.stride(0), scale_inv.stride(1), out.stride(0), out.stride(1),
        QBLOCK_N=bn, QBLOCK_K=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
