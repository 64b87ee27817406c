"""MLA's latent-cache write in one Triton launch (reference: ``reference.mla_cache_write``).

Each step, MLA splits ``kv_a_proj_with_mqa``'s output ``kv [T, r + R]`` into the latent (RMSNorm'd
with ``kv_a_layernorm``) and the shared rope key (rotated by the token's position), concatenates
them again, casts to the cache dtype and scatters the rows to their cache slots
(``engine/layers/mla.py``): a norm (about eight ops), a rope, a cat, a cast and an index_copy. Here
one program per token reads its kv row once and writes the finished cache row to
``cache[slot_mapping[t]]``, with no intermediate tensors. With a query LoRA, the other part of the
same projection (``q_a_proj``'s output) is RMSNorm'd by ``q_a_layernorm`` in the same program: both
norms of the layer input's projection in one launch.

Numerics follow the PyTorch path step for step: the norm rounds to the activation dtype before the
weight multiply and to torch's promotion of (weight, activation) after it; the rope runs in fp32 and
rounds to the activation dtype; then both round to the cache dtype. A negative slot skips its row
(padding rows of a fixed-size decode batch write nothing). Without rope tables (NoPE: Kimi Linear's
and K3's MLA) the key is copied unrotated.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _mla_cache_write_kernel(
    kv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    cache_ptr,
    q_ptr,
    qw_ptr,
    qo_ptr,
    R_LAT,
    HALF,
    P,
    NUM_SLOTS,
    stride_kv,
    stride_cp,
    stride_cache,
    eps,
    Q_DIM,
    stride_q,
    stride_qo,
    q_eps,
    NORM_DTYPE: tl.constexpr,
    BLOCK_LAT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROPE: tl.constexpr = True,
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_Q:  # the query LoRA's RMSNorm, for every row (padding rows included: they are the caller's)
        oq = tl.arange(0, BLOCK_Q)
        mq = oq < Q_DIM
        xq = tl.load(q_ptr + t * stride_q + oq, mask=mq, other=0.0).to(tl.float32)
        hq = (xq * tl.rsqrt(tl.sum(xq * xq, axis=0) / Q_DIM + q_eps)).to(q_ptr.dtype.element_ty).to(tl.float32)
        wq = tl.load(qw_ptr + oq, mask=mq, other=0.0).to(tl.float32)
        tl.store(qo_ptr + t * stride_qo + oq, (hq * wq).to(qo_ptr.dtype.element_ty), mask=mq)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= NUM_SLOTS):  # padding rows; never a write outside the cache
        return
    act = kv_ptr.dtype.element_ty
    out = cache_ptr + slot * stride_cache  # [r + R] cache row
    # latent: HF RMSNorm (fp32 statistics, round to the activation dtype, weight, round to NORM_DTYPE)
    offs = tl.arange(0, BLOCK_LAT)
    m = offs < R_LAT
    x = tl.load(kv_ptr + t * stride_kv + offs, mask=m, other=0.0).to(tl.float32)  # [r]
    h = (x * tl.rsqrt(tl.sum(x * x, axis=0) / R_LAT + eps)).to(act).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    c_kv = (h * w).to(NORM_DTYPE)
    tl.store(out + offs, c_kv.to(cache_ptr.dtype.element_ty), mask=m)
    if not ROPE:  # NoPE (Kimi Linear / K3): the shared key goes to the cache unrotated (HALF: its width)
        i = tl.arange(0, BLOCK_P)
        k_pe = tl.load(kv_ptr + t * stride_kv + R_LAT + i, mask=i < HALF, other=0.0)
        tl.store(out + R_LAT + i, k_pe.to(cache_ptr.dtype.element_ty), mask=i < HALF)
        return
    # shared key: interleaved pairs (x[2i], x[2i+1]) turned by (cos, sin)[pos, i]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_P)
    mp = i < tl.where((pos >= 0) & (pos < P), HALF, 0)  # out-of-cache positions write zeros
    c = tl.load(cos_ptr + pos * stride_cp + i, mask=mp, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cp + i, mask=mp, other=0.0)
    pe = kv_ptr + t * stride_kv + R_LAT + 2 * i
    x0 = tl.load(pe, mask=i < HALF, other=0.0).to(tl.float32)
    x1 = tl.load(pe + 1, mask=i < HALF, other=0.0).to(tl.float32)
    o0 = (x0 * c - x1 * s).to(act)
    o1 = (x0 * s + x1 * c).to(act)
    tl.store(out + R_LAT + 2 * i, o0.to(cache_ptr.dtype.element_ty), mask=i < HALF)
    tl.store(out + R_LAT + 2 * i + 1, o1.to(cache_ptr.dtype.element_ty), mask=i < HALF)


def mla_cache_write(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    q: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    q_eps: float = 1e-6,
) -> torch.Tensor | None:
    """Write ``[rms_norm(kv[:, :r]), rope(kv[:, r:])]`` to ``cache`` rows ``slot_mapping`` in place.
    With ``q [T, Q]`` (``q_a_proj``'s output, a view with a contiguous last dim is fine) and
    ``q_norm_weight [Q]``, also returns ``rms_norm(q) * q_norm_weight`` (HF numerics, dtype: torch's
    promotion of the two) from the same launch; else None.

    ``kv [T, r + R]`` (a view with a contiguous last dim is fine), ``norm_weight [r]``, ``cos``/``sin``
    fp32 ``[P, R/2]``, ``positions``/``slot_mapping`` int32/int64 ``[T]`` (a slot outside the cache,
    e.g. -1 for padding, is skipped: values are not checked on the host, which would sync),
    ``cache [num_blocks, block_size, r + R]`` or already flat ``[slots, r + R]``, contiguous rows.
    ``cos`` and ``sin`` both None: NoPE (Kimi Linear / K3), the key is written unrotated.
    """
    if kv.dim() != 2 or kv.dtype not in FLOAT_DTYPES or kv.stride(-1) != 1:
        raise ValueError(
            f"mla_cache_write: kv must be fp16/bf16/fp32 [T, r + R] with a contiguous last dim, "
            f"got {kv.dtype} {tuple(kv.shape)}"
        )
    t, width = kv.shape
    r = norm_weight.shape[0] if norm_weight.dim() == 1 else -1
    if r <= 0 or r >= width or norm_weight.dtype not in FLOAT_DTYPES or not norm_weight.is_contiguous():
        raise ValueError(
            f"mla_cache_write: norm_weight must be contiguous float [r] with r < {width}, "
            f"got {norm_weight.dtype} {tuple(norm_weight.shape)}"
        )
    rope = width - r
    nope = cos is None and sin is None
    if nope:  # no rotary embedding: dummy tables, never read (positions are not read either)
        cos = sin = torch.empty((1, max(1, rope // 2)), dtype=torch.float32, device=kv.device)
    elif cos is None or sin is None:
        raise ValueError("mla_cache_write: cos and sin are both tensors (rope) or both None (NoPE)")
    bad_width = not nope and (rope % 2 or cos.shape[-1] != rope // 2)
    if bad_width or cos.dim() != 2 or cos.dtype != torch.float32 or not cos.is_contiguous():
        raise ValueError(
            f"mla_cache_write: cos must be contiguous fp32 [P, R/2={rope // 2}] (R = {rope} rope "
            f"channels), got {cos.dtype} {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape or sin.dtype != torch.float32 or not sin.is_contiguous():
        raise ValueError(
            f"mla_cache_write: sin must be contiguous fp32 {tuple(cos.shape)}, got {sin.dtype} {tuple(sin.shape)}"
        )
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.shape != (t,) or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"mla_cache_write: {name} must be int32/int64 [T={t}], got {idx.dtype} {tuple(idx.shape)}")
    if cache.shape[-1] != width or cache.dtype not in FLOAT_DTYPES or not cache.is_contiguous():
        raise ValueError(
            f"mla_cache_write: cache must be contiguous fp16/bf16/fp32 [..., {width}], "
            f"got {cache.dtype} {tuple(cache.shape)}"
        )
    q_out = None
    if q is not None:
        if q.dim() != 2 or q.shape[0] != t or q.dtype not in FLOAT_DTYPES or q.stride(-1) != 1:
            raise ValueError(
                f"mla_cache_write: q must be fp16/bf16/fp32 [T={t}, Q] with a contiguous last dim, "
                f"got {q.dtype} {tuple(q.shape)}"
            )
        if (
            q_norm_weight is None
            or q_norm_weight.shape != (q.shape[1],)
            or q_norm_weight.dtype not in FLOAT_DTYPES
            or not q_norm_weight.is_contiguous()
        ):
            raise ValueError(
                f"mla_cache_write: q_norm_weight must be contiguous float [Q={q.shape[1]}], got "
                f"{None if q_norm_weight is None else tuple(q_norm_weight.shape)}"
            )
        q_out = torch.empty(q.shape, dtype=torch.promote_types(q_norm_weight.dtype, q.dtype), device=q.device)
    flat = cache.view(-1, width)  # [slots, r + R]
    check_device(kv, norm_weight, cos, sin, positions, slot_mapping, flat, *([] if q is None else [q, q_norm_weight]))
    if t:
        qa = (q, q_norm_weight, q_out) if q is not None else (kv, norm_weight, kv)  # dummies, never read
        _mla_cache_write_kernel[(t,)](
            kv,
            norm_weight,
            cos,
            sin,
            positions,
            slot_mapping,
            flat,
            *qa,
            r,
            rope if nope else rope // 2,
            cos.shape[0],
            flat.shape[0],
            kv.stride(0),
            cos.stride(0),
            flat.stride(0),
            eps,
            qa[0].shape[1],
            qa[0].stride(0),
            qa[2].stride(0),
            q_eps,
            NORM_DTYPE=_TL_DTYPES[torch.promote_types(norm_weight.dtype, kv.dtype)],
            BLOCK_LAT=triton.next_power_of_2(r),
            BLOCK_P=triton.next_power_of_2(rope if nope else rope // 2),
            HAS_Q=q is not None,
            BLOCK_Q=triton.next_power_of_2(qa[0].shape[1]),
            ROPE=not nope,
        )
    return q_out
