"""MLA decode over the paged latent cache, in the absorbed form (reference:
``reference.mla_decode_reference``).

Each sequence has one query per head: ``q = [q_nope @ W_UK, q_pe]`` of width r + rope. Its keys are
the cached rows ``[c_kv, k_pe]`` and its values the latents ``c_kv`` themselves, read in place
through the block table: no gathered copy of the context. Programs split a sequence's context
into ``num_splits`` ranges (flash-decoding) so that a small batch still fills the device. The grid
depends only on the batch and a bound on the context (the step's longest, or a CUDA graph's
capacity); each sequence's ranges are sized in the kernel from its own length, so a short sequence
next to a long one, or under a graph captured for long ones, still spreads over the splits. Each
keeps a running max and sum (online softmax) over tiles of BLOCK_N cached tokens for BLOCK_H
heads, and writes its unnormalised partial result; a second launch merges the splits (one launch
instead of the ~9 PyTorch ops of the same merge: the decode step is launch-bound).
"""

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, interpreting


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, table_ptr, lens_ptr, acc_ptr, ml_ptr,
    H, num_splits, block_size, scale,
    stride_qb, stride_qh, stride_cs, stride_tb,
    stride_ab, stride_as, stride_ah, stride_mb, stride_ms, stride_mh,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + b)
    # This sequence's own split length: its context in num_splits ranges of whole tiles, at least
    # MIN_TILES tiles each (the grid is fixed by the batch's bound, e.g. a CUDA graph's capacity, so a
    # short sequence still spreads over several programs instead of filling the first split alone).
    tiles = (context + BLOCK_N - 1) // BLOCK_N
    split_len = tl.maximum((tiles + num_splits - 1) // num_splits, MIN_TILES) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context)  # start >= end: an empty split, merged as nothing

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < H
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # [BH, BR]
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=mask_h[:, None] & mask_p[None, :], other=0.0)  # [BH, BP]

    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        block = tl.load(table_ptr + b * stride_tb + pos // block_size, mask=mask_n, other=0).to(tl.int64)
        rows = cache_ptr + (block * block_size + pos % block_size)[:, None] * stride_cs
        kv = tl.load(rows + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [BN, BR]
        pe = tl.load(rows + R + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :], other=0.0)  # [BN, BP]
        kv = kv.to(q_lat.dtype)
        scores = tl.dot(q_lat, tl.trans(kv), input_precision="ieee")
        scores = tl.dot(q_pe, tl.trans(pe.to(q_pe.dtype)), scores, input_precision="ieee") * scale
        scores = tl.where(mask_n[None, :], scores, float("-inf"))  # [BH, BN]
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee")
        m = m_new

    split64 = split.to(tl.int64)
    tl.store(acc_ptr + b * stride_ab + split64 * stride_as + heads[:, None] * stride_ah + offs_r[None, :], acc,
             mask=mask_h[:, None] & mask_r[None, :])
    ml = ml_ptr + b * stride_mb + split64 * stride_ms + heads * stride_mh
    tl.store(ml, m, mask=mask_h)
    tl.store(ml + 1, l, mask=mask_h)


@triton.jit
def _mla_merge_kernel(
    acc_ptr, ml_ptr, out_ptr, H, S,
    stride_ab, stride_as, stride_ah, stride_mb, stride_ms, stride_mh, stride_ob, stride_oh,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # out[b, h] = sum_s acc[b, s, h] * w_s / sum_s l[b, s, h] * w_s with w_s = exp(m_s - max_s m_s);
    # a split past its sequence's end kept m = -inf and l = 0 (and acc = 0), so weighs nothing.
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < H
    offs_r = tl.arange(0, BLOCK_R)
    mask = mask_h[:, None] & (offs_r[None, :] < R)
    ml = ml_ptr + b * stride_mb + heads * stride_mh
    m_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    for s in range(0, S):
        m_max = tl.maximum(m_max, tl.load(ml + s * stride_ms, mask=mask_h, other=float("-inf")))
    m_max = tl.where(mask_h, m_max, 0.0)  # padding heads: no -inf - -inf
    num = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    den = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in range(0, S):
        w = tl.exp(tl.load(ml + s * stride_ms, mask=mask_h, other=float("-inf")) - m_max)  # [BH]
        den += tl.load(ml + s * stride_ms + 1, mask=mask_h, other=0.0) * w
        a = tl.load(acc_ptr + b * stride_ab + s * stride_as + heads[:, None] * stride_ah + offs_r[None, :],
                    mask=mask, other=0.0)
        num += a * w[:, None]
    out = num / tl.where(mask_h, den, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


_MIN_TILES = 4  # the shortest split, in tiles of BLOCK_N tokens


def _num_splits(batch: int, head_blocks: int, max_context_len: int, block_n: int) -> int:
    # Enough programs to fill a large GPU (about 256); no more splits than the longest context has
    # minimum-length splits (the kernel sizes each sequence's splits from its own length).
    want = triton.cdiv(256, batch * head_blocks)
    return max(1, min(want, triton.cdiv(max_context_len, _MIN_TILES * block_n)))


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               max_context_len: int, block_size: int, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, r + rope], cache [slots, r + rope] (latent then rope key),
    block_tables [B, max_blocks] int32, context_lens [B] int32 (>= 1, <= max_context_len) -> [B, H, r]
    in q.dtype."""
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be a 3-D fp16/bf16/fp32 tensor [B, H, r + rope], got {tuple(q.shape)} {q.dtype}")
    b, h, width = q.shape
    r = kv_lora_rank
    if not 0 < r < width:
        raise ValueError(f"kv_lora_rank {r} must be positive and below the query width {width}")
    if cache.dim() != 2 or cache.shape[1] != width or cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"cache must be fp16/bf16/fp32 [slots, {width}], got {tuple(cache.shape)} {cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [B={b}, max_blocks], got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if tuple(context_lens.shape) != (b,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [B={b}], got {tuple(context_lens.shape)} {context_lens.dtype}")
    if block_size <= 0 or max_context_len <= 0:
        raise ValueError(f"block_size ({block_size}) and max_context_len ({max_context_len}) must be positive")
    if q.stride(-1) != 1 or cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, cache and block_tables must be contiguous in their last dimension")
    check_device(q, cache, block_tables, context_lens)
    block_h = 16
    block_n = 16 if interpreting() else 64
    head_blocks = triton.cdiv(h, block_h)
    splits = _num_splits(b, head_blocks, max_context_len, block_n)
    acc = torch.empty((b, splits, h, r), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, splits, h, 2), dtype=torch.float32, device=q.device)  # running max, sum
    _mla_decode_kernel[(b, head_blocks, splits)](
        q, cache, block_tables, context_lens, acc, ml,
        h, splits, block_size, scale,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
        R=r, P=width - r, BLOCK_R=triton.next_power_of_2(r), BLOCK_P=max(16, triton.next_power_of_2(width - r)),
        BLOCK_H=block_h, BLOCK_N=block_n, MIN_TILES=_MIN_TILES,
    )
    out = torch.empty((b, h, r), dtype=q.dtype, device=q.device)
    _mla_merge_kernel[(b, head_blocks)](
        acc, ml, out, h, splits,
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
        out.stride(0), out.stride(1),
        R=r, BLOCK_R=triton.next_power_of_2(r), BLOCK_H=block_h,
    )
    return out
