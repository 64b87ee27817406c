"""YaRN rope of MLA's query heads and its shared key in one Triton launch
(reference: ``reference.rope_mla``).

MLA rotates the last ``qk_rope_head_dim`` channels of every query head (``q_pe [T, H, R]``) and the
one shared key (``k_pe [T, R]``, the tail of ``kv_a_proj_with_mqa``'s output) by the same positions.
Op by op that is a cat, a float cast, two cache gathers, four multiplies, two adds, a stack, a cast
and a split (about 14 launches); here one program per token reads its cos/sin row once and rotates
all H + 1 rows, reading the inputs through their strides (no cat, no copy of the q/kv views).

Convention (DeepSeek-V3 / Kimi K2, ``engine/layers/rope.py``): interleaved pairs
``(x[2i], x[2i+1])`` rotate by angle ``pos * inv_freq[i]``; ``cos``/``sin`` are the fp32 caches
``[max_position, R/2]`` with the YaRN amplitude already folded in. The rotation runs in fp32 and
rounds once to the input dtype, as the PyTorch path does.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device


@triton.jit
def _rotate(src_ptr, dst_ptr, rows, stride_src, stride_dst, c, s, mask, i):
    # rows [BH] row offsets, i [BP] pair index; c, s [BP] fp32. Reads both halves before writing,
    # so src == dst (in place) is safe.
    rows = rows.to(tl.int64)
    even = rows[:, None] * stride_src + 2 * i[None, :]
    x0 = tl.load(src_ptr + even, mask=mask, other=0.0).to(tl.float32)  # [BH, BP]
    x1 = tl.load(src_ptr + even + 1, mask=mask, other=0.0).to(tl.float32)
    o0 = x0 * c[None, :] - x1 * s[None, :]
    o1 = x0 * s[None, :] + x1 * c[None, :]
    out = dst_ptr + rows[:, None] * stride_dst + 2 * i[None, :]
    tl.store(out, o0.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, o1.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_mla_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    H,
    HALF,
    P,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_cp,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_P)
    # a position past the cache rotates by nothing and zeroes the row (visible, never out of bounds)
    pairs = tl.where((pos >= 0) & (pos < P), HALF, 0)
    mask_i = i < pairs
    c = tl.load(cos_ptr + pos * stride_cp + i, mask=mask_i, other=0.0)  # [BP] fp32
    s = tl.load(sin_ptr + pos * stride_cp + i, mask=mask_i, other=0.0)
    heads = tl.arange(0, BLOCK_H)
    mask_q = (heads[:, None] < H) & (i[None, :] < HALF)
    _rotate(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, heads, stride_qh, stride_qoh, c, s, mask_q, i)
    one = tl.arange(0, 1)
    mask_k = (one[:, None] < 1) & (i[None, :] < HALF)
    _rotate(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, one, 0, 0, c, s, mask_k, i)


def _check_rows(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"rope_mla: {name} must be {dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"rope_mla: {name} must have a contiguous last dim, got strides {t.stride()}")


def rope_mla(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q_pe [T, H, R]`` and ``k_pe [T, R]`` (or ``[T, 1, R]``) by ``positions [T]``.

    ``cos``/``sin``: fp32 ``[P, R/2]``. Inputs may be strided views (the rope tail of q, of kv).
    Returns ``(q_out, k_out)`` in the inputs' dtype and shapes; pass ``q_out=q_pe, k_out=k_pe`` to
    rotate in place. Positions are not range-checked on the host (that would be a device sync); a
    position outside the cache zeroes its rows instead of reading out of bounds.
    """
    if q_pe.dim() != 3:
        raise ValueError(f"rope_mla: q_pe must be [T, H, R], got {tuple(q_pe.shape)}")
    t, h, r = q_pe.shape
    if q_pe.dtype not in FLOAT_DTYPES or r % 2:
        raise ValueError(f"rope_mla: q_pe must be fp16/bf16/fp32 with an even R, got {q_pe.dtype} R={r}")
    k_shape = tuple(k_pe.shape)
    if k_shape not in ((t, r), (t, 1, r)):
        raise ValueError(f"rope_mla: k_pe must be [T={t}, R={r}] or [T, 1, R], got {k_shape}")
    k2 = k_pe.reshape(t, r) if k_pe.dim() == 3 else k_pe  # [T, R], a view
    _check_rows("q_pe", q_pe, (t, h, r), q_pe.dtype)
    _check_rows("k_pe", k2, (t, r), q_pe.dtype)
    if cos.dim() != 2 or cos.shape[1] != r // 2 or cos.dtype != torch.float32 or not cos.is_contiguous():
        raise ValueError(f"rope_mla: cos must be contiguous fp32 [P, R/2={r // 2}], got {cos.dtype} {tuple(cos.shape)}")
    if sin.shape != cos.shape or sin.dtype != torch.float32 or not sin.is_contiguous():
        raise ValueError(
            f"rope_mla: sin must be contiguous fp32 {tuple(cos.shape)}, got {sin.dtype} {tuple(sin.shape)}"
        )
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rope_mla: positions must be int32/int64 [T={t}], got {positions.dtype} {tuple(positions.shape)}"
        )
    q_out = torch.empty_like(q_pe) if q_out is None else q_out
    k_out = torch.empty_like(k_pe) if k_out is None else k_out
    if tuple(k_out.shape) != k_shape:
        raise ValueError(f"rope_mla: k_out must be {list(k_shape)}, got {tuple(k_out.shape)}")
    ko2 = k_out.reshape(t, r) if k_out.dim() == 3 else k_out
    _check_rows("q_out", q_out, (t, h, r), q_pe.dtype)
    _check_rows("k_out", ko2, (t, r), q_pe.dtype)
    check_device(q_pe, k2, cos, sin, positions, q_out, ko2)
    if t:
        _rope_mla_kernel[(t,)](
            q_pe,
            k2,
            q_out,
            ko2,
            cos,
            sin,
            positions,
            h,
            r // 2,
            cos.shape[0],
            q_pe.stride(0),
            q_pe.stride(1),
            k2.stride(0),
            q_out.stride(0),
            q_out.stride(1),
            ko2.stride(0),
            cos.stride(0),
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_P=triton.next_power_of_2(r // 2),
        )
    return q_out, k_out
