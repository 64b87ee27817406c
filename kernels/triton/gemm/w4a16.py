"""W4A16 GEMM: bf16/fp16 activations times compressed-tensors INT4 weights, dequantised in-kernel.

Weight layout (compressed-tensors pack-quantized, see ``kernels.reference``): ``packed`` int32 [N, ceil(K/8)], column k in word k // 8 at
bits 4*(k % 8), offset-8; ``scale`` [N, ceil(K/group_size)]. Reference: ``reference.linear_w4a16``.
"""

import torch
import triton
import triton.language as tl

from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device, interpreting


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        # Each word is gathered once per nibble; the 8 reads of one word hit the same cache line.
        words = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 8) * stride_wk,
            mask=mask_w, other=0,
        )  # [BK, BN] int32, raw bits
        # Arithmetic shift then mask: correct for negative words too.
        q = ((words >> ((offs_k[:, None] % 8) * 4)) & 0xF) - 8
        s = tl.load(
            s_ptr + offs_n[None, :] * stride_sn + (offs_k[:, None] // GROUP_SIZE) * stride_sk,
            mask=mask_w, other=0.0,
        )  # [BK, BN]
        w = (q.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )




def _block_m(m: int) -> int:
    # Decode (M <= 16) wastes least with 16-row tiles; tl.dot needs at least 16.
    return 16 if m <= 16 else 32 if m <= 32 else 64


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """``x [M, K] @ dequant_int4(packed, scale).T -> [M, N]`` in x.dtype.

    ``packed`` int32 [N, ceil(K/8)], ``scale`` [N, ceil(K/group_size)] (bf16/fp16/fp32).
    """
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != -(-k // 8):
        raise ValueError(
            f"packed must be int32 [N, ceil(K/8)={-(-k // 8)}], got {tuple(packed.shape)} {packed.dtype}"
        )
    n = packed.shape[0]
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    groups = -(-k // group_size)
    if scale.dtype not in FLOAT_DTYPES or tuple(scale.shape) != (n, groups):
        raise ValueError(f"scale must be float [N={n}, ceil(K/g)={groups}], got {tuple(scale.shape)} {scale.dtype}")
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("packed and scale must be contiguous")
    check_device(x, packed, scale)

    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _block_m(m), 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_gemm_kernel[grid](
        x, packed, scale, out, m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1),
        scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
