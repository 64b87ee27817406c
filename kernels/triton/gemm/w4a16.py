"""W4A16 GEMM: bf16/fp16 activations times compressed-tensors INT4 weights, dequantised in-kernel.

Weight layout (compressed-tensors pack-quantized, see ``kernels.reference``): ``packed`` int32 [N, ceil(K/8)], column k in word k // 8 at
bits 4*(k % 8), offset-8; ``scale`` [N, ceil(K/group_size)]. Reference: ``reference.linear_w4a16``.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device
from kimitui.kernels.triton.split_k import finish, outputs, plan_gemm


@triton.jit
def _int4_tile(words, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # words [BK/8, BN] int32, each loaded once -> the signed INT4 values [BK, BN]: row k of the tile
    # is word k // 8, nibble k % 8 (arithmetic shift then mask: correct for negative words too)
    q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # [BK/8, 8, BN]
    return tl.reshape(q, (BLOCK_K, BLOCK_N)) - 8


@triton.jit
def _int4_scales(
    s_row, k0, GROUPS, mask_n, stride_sk, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    # The fp32 scales of K-tile [k0, k0 + BK) at s_row [1, BN] (a row of scale pointers), each group's
    # loaded once: [BK, BN], or [1, BN] when the tile lies inside one group.
    if BLOCK_K % GROUP_SIZE == 0:  # BK/G groups in the tile: load each scale once, repeat it G times
        groups = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
        sg = tl.load(
            s_row + groups.to(tl.int64)[:, None] * stride_sk,
            mask=(groups < GROUPS)[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)  # [BK/G, BN]
        sc = tl.reshape(
            tl.broadcast_to(sg[:, None, :], (BLOCK_K // GROUP_SIZE, GROUP_SIZE, BLOCK_N)), (BLOCK_K, BLOCK_N)
        )
    elif GROUP_SIZE % BLOCK_K == 0:  # the tile lies in one group: one scale row
        group = ((k0 + tl.zeros((1,), dtype=tl.int32)) // GROUP_SIZE).to(tl.int64)  # [1]
        sc = tl.load(s_row + group[:, None] * stride_sk, mask=mask_n[None, :], other=0.0).to(tl.float32)
    else:  # a group size that does not tile BLOCK_K: gathered per element
        groups = (k0 + tl.arange(0, BLOCK_K)) // GROUP_SIZE
        sc = tl.load(
            s_row + groups.to(tl.int64)[:, None] * stride_sk,
            mask=(groups < GROUPS)[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)
    return sc


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    KW,
    GROUPS,
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
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program (m, n, s): output tile (m, n), K-steps [s * STEPS, (s + 1) * STEPS). Each packed word
    # is loaded once per tile ([BK/8, BN] words) and its 8 nibbles unpacked in registers; the scales
    # once per group ([BK/GROUP, BN], or one row when a group spans several tiles).
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
    lanes_w = tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_begin + lanes_k).to(tl.int64)[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_begin // 8 + lanes_w).to(tl.int64)[:, None] * stride_wk
    s_row = s_ptr + offs_n[None, :] * stride_sn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None] & ((k0 + lanes_k) < K)[None, :], other=0.0)  # [BM, BK]
        words = tl.load(w_ptrs, mask=((k0 // 8 + lanes_w) < KW)[:, None] & mask_n[None, :], other=0)  # [BK/8, BN]
        q = _int4_tile(words, BLOCK_K, BLOCK_N)
        sc = _int4_scales(s_row, k0, GROUPS, mask_n, stride_sk, GROUP_SIZE, BLOCK_K, BLOCK_N)
        w = (q.to(tl.float32) * sc).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += (BLOCK_K // 8) * stride_wk
    # SPLIT: the fp32 partial of this K range, summed by split_k's reduce kernel
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc if SPLIT else acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """``x [M, K] @ dequant_int4(packed, scale).T -> [M, N]`` in x.dtype.

    ``packed`` int32 [N, ceil(K/8)], ``scale`` [N, ceil(K/group_size)] (bf16/fp16/fp32).
    """
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != -(-k // 8):
        raise ValueError(f"packed must be int32 [N, ceil(K/8)={-(-k // 8)}], got {tuple(packed.shape)} {packed.dtype}")
    n = packed.shape[0]
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    groups = -(-k // group_size)
    if scale.dtype not in FLOAT_DTYPES or tuple(scale.shape) != (n, groups):
        raise ValueError(f"scale must be float [N={n}, ceil(K/g)={groups}], got {tuple(scale.shape)} {scale.dtype}")
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("packed and scale must be contiguous")
    check_device(x, packed, scale)

    plan = plan_gemm(m, n, k)
    out, target = outputs(plan, x.dtype, x.device)
    split = plan.split > 1
    _w4a16_gemm_kernel[plan.grid](
        x,
        packed,
        scale,
        target,
        m,
        n,
        k,
        packed.shape[1],
        groups,
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
        GROUP_SIZE=group_size,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        SPLIT=split,
    )
    return finish(plan, out, target)
