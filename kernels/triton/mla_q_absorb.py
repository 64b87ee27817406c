"""MLA's absorbed decode query in one Triton launch (reference: a bmm by W_UK and the query rope, as
``Backend.mla_absorb_query`` composes them).

The absorbed decode scores a query ``[q_nope @ W_UK, rope(q_pe)]`` of width r + R per head against
the cached ``[c_kv, k_pe]`` rows (``kernels/triton/mla_decode.py``). Op by op that is a batched GEMM per
head, a rope and a cat (three launches; two with the rope and the GEMM writing into one buffer). Here
program (h, r block, batch block) multiplies its batch rows' ``q_nope[:, h]`` by the ``W_UK[h]``
columns of its r block (one tile of W_UK read once per batch block, fp32 accumulation, one rounding)
and the programs of r block 0 also rotate the batch rows' ``q_pe[:, h]`` into the tail.

Rope convention as ``kernels/triton/rope_fused.py``: interleaved pairs turned by the fp32 ``cos``/``sin``
caches ``[P, R/2]`` (YaRN amplitude folded in), in fp32, rounded once; a position outside the cache
zeroes its row (never an out-of-bounds read). Without rope tables (NoPE: Kimi Linear's and K3's MLA)
the tail is q_pe copied.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device


@triton.jit
def _mla_q_absorb_kernel(
    q_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    out_ptr,
    B,
    NOPE,
    R,
    HALF,
    P,
    stride_qb,
    stride_qh,
    stride_wh,
    stride_wn,
    stride_ob,
    stride_oh,
    stride_cp,
    BLOCK_B: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ROPE: tl.constexpr = True,
):
    h = tl.program_id(0).to(tl.int64)
    r_block = tl.program_id(1)
    offs_b = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    q_rows = q_ptr + offs_b.to(tl.int64)[:, None] * stride_qb + h * stride_qh  # [BB, 1]
    out_rows = out_ptr + offs_b.to(tl.int64)[:, None] * stride_ob + h * stride_oh
    acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, NOPE, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < NOPE
        a = tl.load(q_rows + offs_k[None, :], mask=mask_b[:, None] & mask_k[None, :], other=0.0)  # [BB, BK]
        w = tl.load(
            w_ptr + h * stride_wh + offs_k.to(tl.int64)[:, None] * stride_wn + offs_r[None, :],
            mask=mask_k[:, None] & mask_r[None, :],
            other=0.0,
        )  # [BK, BR]
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision="ieee")
    tl.store(out_rows + offs_r[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask_b[:, None] & mask_r[None, :])
    if not ROPE:  # NoPE: the tail is q_pe unrotated (HALF: its width), once per batch row
        if r_block == 0:
            i = tl.arange(0, BLOCK_P)
            mask_i = mask_b[:, None] & (i[None, :] < HALF)
            pe = tl.load(q_rows + NOPE + i[None, :], mask=mask_i, other=0.0)
            tl.store(out_rows + R + i[None, :], pe.to(out_ptr.dtype.element_ty), mask=mask_i)
    elif r_block == 0:  # the rope tail of this head, once per batch row
        i = tl.arange(0, BLOCK_P)
        pos = tl.load(pos_ptr + offs_b, mask=mask_b, other=-1).to(tl.int64)  # [BB]
        inside = (pos >= 0) & (pos < P)
        mask_i = mask_b[:, None] & (i[None, :] < HALF)
        mask_c = mask_i & inside[:, None]
        c = tl.load(cos_ptr + pos[:, None] * stride_cp + i[None, :], mask=mask_c, other=0.0)  # [BB, BP]
        s = tl.load(sin_ptr + pos[:, None] * stride_cp + i[None, :], mask=mask_c, other=0.0)
        src = q_rows + NOPE + 2 * i[None, :]
        x0 = tl.load(src, mask=mask_i, other=0.0).to(tl.float32)
        x1 = tl.load(src + 1, mask=mask_i, other=0.0).to(tl.float32)
        dst = out_rows + R + 2 * i[None, :]
        tl.store(dst, (x0 * c - x1 * s).to(out_ptr.dtype.element_ty), mask=mask_i)
        tl.store(dst + 1, (x0 * s + x1 * c).to(out_ptr.dtype.element_ty), mask=mask_i)


def mla_q_absorb(
    q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor
) -> torch.Tensor:
    """``q [B, H, nope + R]`` (q_b_proj's output per head, rows may be strided, last dim contiguous),
    ``w_uk [H, nope, r]``, ``cos``/``sin`` fp32 ``[P, R/2]``, ``positions [B]`` ->
    ``[B, H, r + R]`` in q.dtype: ``[q_nope @ W_UK[h], rope(q_pe)]`` per head. ``cos`` and ``sin``
    both None: NoPE (Kimi Linear / K3), ``[q_nope @ W_UK[h], q_pe]``."""
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES or q.stride(-1) != 1:
        raise ValueError(
            f"mla_q_absorb: q must be fp16/bf16/fp32 [B, H, nope + R] with a contiguous last dim, "
            f"got {q.dtype} {tuple(q.shape)}"
        )
    b, h, width = q.shape
    if w_uk.dim() != 3 or w_uk.shape[0] != h or not 0 < w_uk.shape[1] < width or w_uk.stride(-1) != 1:
        raise ValueError(
            f"mla_q_absorb: w_uk must be [H={h}, nope < {width}, r] with a contiguous last dim, got {tuple(w_uk.shape)}"
        )
    nope, r = w_uk.shape[1], w_uk.shape[2]
    rope = width - nope
    if w_uk.dtype not in FLOAT_DTYPES:
        raise ValueError(f"mla_q_absorb: w_uk must be fp16/bf16/fp32, got {w_uk.dtype}")
    no_rope = cos is None and sin is None
    if no_rope:  # no rotary embedding: dummy tables, never read (positions are not read either)
        cos = sin = torch.empty((1, max(1, rope // 2)), dtype=torch.float32, device=q.device)
    elif cos is None or sin is None:
        raise ValueError("mla_q_absorb: cos and sin are both tensors (rope) or both None (NoPE)")
    bad_width = not no_rope and (rope % 2 or cos.shape[1] != rope // 2)
    if bad_width or cos.dim() != 2 or cos.dtype != torch.float32 or not cos.is_contiguous():
        raise ValueError(
            f"mla_q_absorb: cos must be contiguous fp32 [P, R/2={rope // 2}], got {cos.dtype} {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape or sin.dtype != torch.float32 or not sin.is_contiguous():
        raise ValueError(
            f"mla_q_absorb: sin must be contiguous fp32 {tuple(cos.shape)}, got {sin.dtype} {tuple(sin.shape)}"
        )
    if positions.shape != (b,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"mla_q_absorb: positions must be int32/int64 [B={b}], got {positions.dtype} {tuple(positions.shape)}"
        )
    out = torch.empty((b, h, r + rope), dtype=q.dtype, device=q.device)
    check_device(q, w_uk, cos, sin, positions, out)
    if b and h:
        block_b = min(64, max(16, triton.next_power_of_2(b)))
        block_r = min(64, max(16, triton.next_power_of_2(r)))
        block_k = min(64, max(16, triton.next_power_of_2(nope)))
        _mla_q_absorb_kernel[(h, triton.cdiv(r, block_r), triton.cdiv(b, block_b))](
            q,
            w_uk,
            cos,
            sin,
            positions,
            out,
            b,
            nope,
            r,
            rope if no_rope else rope // 2,
            cos.shape[0],
            q.stride(0),
            q.stride(1),
            w_uk.stride(0),
            w_uk.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            BLOCK_B=block_b,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            BLOCK_P=max(2, triton.next_power_of_2(rope if no_rope else rope // 2)),
            ROPE=not no_rope,
        )
    return out
