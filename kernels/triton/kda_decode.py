"""One KDA decode step in one Triton launch (reference: ``Backend.kda_decode``, the PyTorch ops of
``kernels.kda`` composed).

Op by op a KDA decode step is about seventy small launches between the input projections and
o_proj (``engine/layers/kda.py``): the short conv's gather, window, multiply-add, SiLU and scatter;
the forget gate (bias add, exp of A_log, sigmoid or softplus); beta's sigmoid; the q/k L2 norms;
the gated delta-rule step (decay, two products with the state, the rank-1 update, the gather and
scatter of the state rows); and the output's RMSNorm gated by sigmoid(gate). Here program (n, h)
does all of it for sequence n's head h: it reads the head's q, k, v channels of the fused
projection and their conv history, the head's state S [K, V] from the sequence's slot, and writes
back the conv history, S and the head's normed, gated output row. S is streamed in [K, 32] column
tiles (whole at head_dim 128 it spills on sm_90 even over 16 warps); each tile's raw outputs go to
the output row, and after a barrier the program reads the row back for the norm, which needs it
whole: the output norm runs in the same launch.

Numerics follow the PyTorch path step for step: the conv runs in fp32 on the fp32 weights and rounds
to the activation dtype (what q, k, v are there); gate, beta, norms and the state update in fp32; the
output rounds to the activation dtype before its gated RMSNorm (fp32) and once more after it.
Recurrence as fla's ``fused_recurrent_kda`` (fla-org/flash-linear-attention,
``fla/ops/kda/fused_recurrent.py``): S <- exp(g) * S; S <- S + k (beta (v - k^T S))^T; o = S^T q.
A slot outside the pool (a padding row) writes zeros to its output and touches no state.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device


@triton.jit
def _conv_silu(qkv_row, conv_row, convw_ptr, ch, m, stride_cc, stride_cw, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """Channels ``ch`` (mask ``m``) of one row: conv over (history, input) + SiLU in fp32, rounded to
    the activation dtype; the history shifted by one and the input appended, written back."""
    j = tl.arange(0, BLOCK_W)
    ch = ch.to(tl.int64)
    mw_old = m[:, None] & (j[None, :] < W - 1)  # the history's W-1 columns, oldest first
    mw_new = m[:, None] & (j[None, :] < W - 2)  # the shifted history keeps W-2 of them
    x = tl.load(qkv_row + ch, mask=m, other=0.0).to(tl.float32)
    hist = tl.load(conv_row + ch[:, None] * stride_cc + j[None, :], mask=mw_old, other=0.0).to(tl.float32)
    w_old = tl.load(convw_ptr + ch[:, None] * stride_cw + j[None, :], mask=mw_old, other=0.0)
    w_new = tl.load(convw_ptr + ch * stride_cw + (W - 1), mask=m, other=0.0)
    y = tl.sum(hist * w_old, axis=1) + x * w_new
    y = y * tl.sigmoid(y)
    shifted = tl.load(conv_row + ch[:, None] * stride_cc + (j[None, :] + 1), mask=mw_new, other=0.0)
    new_hist = tl.where(j[None, :] == W - 2, x[:, None], shifted.to(tl.float32))
    tl.store(conv_row + ch[:, None] * stride_cc + j[None, :], new_hist.to(conv_row.dtype.element_ty), mask=mw_old)
    return y.to(qkv_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _kda_decode_kernel(
    qkv_ptr,
    fb_ptr,
    b_ptr,
    gate_ptr,
    convw_ptr,
    alog_ptr,
    dtb_ptr,
    normw_ptr,
    conv_ptr,
    rec_ptr,
    slot_ptr,
    out_ptr,
    H,
    D,
    P,
    NUM_SLOTS,
    stride_qkv,
    stride_fb,
    stride_b,
    stride_gate,
    stride_cw,
    stride_cs,
    stride_cc,
    stride_rs,
    stride_rh,
    stride_rk,
    stride_out,
    scale,
    eps,
    lower_bound,
    W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SAFE_GATE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    act = qkv_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    out_row = out_ptr + n * stride_out + h * D
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if (slot < 0) | (slot >= NUM_SLOTS):  # padding row: no state read or written
        tl.store(out_row + offs, tl.zeros((BLOCK_D,), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=m)
        return
    qkv_row = qkv_ptr + n * stride_qkv
    conv_row = conv_ptr + slot * stride_cs

    # --- short causal conv + SiLU of the head's q and k channels (fp32, as the weights); v below --
    q = _conv_silu(qkv_row, conv_row, convw_ptr, h * D + offs, m, stride_cc, stride_cw, W, BLOCK_W)
    k = _conv_silu(qkv_row, conv_row, convw_ptr, P + h * D + offs, m, stride_cc, stride_cw, W, BLOCK_W)

    # --- forget gate (log space), beta ---------------------------------------------------------
    a = tl.load(fb_ptr + n * stride_fb + h * D + offs, mask=m, other=0.0).to(tl.float32)
    a = a + tl.load(dtb_ptr + h * D + offs, mask=m, other=0.0)
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if SAFE_GATE:  # Kimi K3: lower_bound * sigmoid(exp(A_log) * a)
        g = lower_bound * tl.sigmoid(rate * a)
    else:  # Kimi Linear: -exp(A_log) * softplus(a), softplus(a) = a above 20
        sp = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        g = -rate * sp
    decay = tl.exp(g)
    beta = tl.sigmoid(tl.load(b_ptr + n * stride_b + h).to(tl.float32))

    # --- gated delta rule on the slot's state, BLOCK_V value columns at a time -----------------
    # Each column block of S is independent (its own v, k^T S and update); one [K, BLOCK_V] tile
    # at a time keeps the registers free of spills at head_dim 128.
    qs = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    ks = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    qk = tl.sum(qs * ks, axis=0)
    s_rows = rec_ptr + slot * stride_rs + h * stride_rh + offs[:, None] * stride_rk  # [K, 1]
    sq = tl.sum(tl.zeros((BLOCK_V,), dtype=tl.float32), axis=0)  # sum of the rounded outputs' squares
    for c in tl.static_range(BLOCK_D // BLOCK_V):
        cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
        mc = cols < D
        v = _conv_silu(qkv_row, conv_row, convw_ptr, 2 * P + h * D + cols, mc, stride_cc, stride_cw, W, BLOCK_W)
        ms = m[:, None] & mc[None, :]
        S = tl.load(s_rows + cols[None, :], mask=ms, other=0.0) * decay[:, None]  # [K, BV]
        u = tl.sum(ks[:, None] * S, axis=0)  # what the memory predicts for k
        qS = tl.sum(qs[:, None] * S, axis=0)
        delta = beta * (v - u)
        o = (qS + qk * delta).to(act)  # q^T (S + k delta^T) without reading S again
        tl.store(s_rows + cols[None, :], S + ks[:, None] * delta[None, :], mask=ms)
        tl.store(out_row + cols, o, mask=mc)
        of = tl.where(mc, o.to(tl.float32), 0.0)
        sq += tl.sum(of * of, axis=0)
    tl.debug_barrier()  # the row's raw outputs, written by other threads, are read back below

    # --- RMSNorm of the head's output times sigmoid(gate) --------------------------------------
    o = tl.load(out_row + offs, mask=m, other=0.0).to(tl.float32)
    o = o * tl.rsqrt(sq / D + eps)
    wn = tl.load(normw_ptr + offs, mask=m, other=0.0).to(tl.float32)
    gt = tl.load(gate_ptr + n * stride_gate + h * D + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_row + offs, (o * wn * tl.sigmoid(gt)).to(out_ptr.dtype.element_ty), mask=m)


def _rows(name: str, t: torch.Tensor, n: int, width: int) -> None:
    if t.dim() != 2 or t.shape != (n, width) or t.dtype not in FLOAT_DTYPES or t.stride(-1) != 1:
        raise ValueError(
            f"kda_decode: {name} must be fp16/bf16/fp32 [N={n}, {width}] with a contiguous last dim, "
            f"got {t.dtype} {tuple(t.shape)}"
        )


def kda_decode(
    qkv: torch.Tensor,
    f_b: torch.Tensor,
    b: torch.Tensor,
    gate: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    rec_state: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode token for each of N sequences -> the gated, normed output [N, H*D] in qkv.dtype
    (o_proj's input); the slots' conv history and delta-rule state are updated in place.

    ``qkv [N, 3P]`` (q | k | v projections, P = H*D; row-strided views fine), ``f_b [N, P]``
    (f_b_proj's output), ``b [N, H]`` (b_proj's), ``gate [N, P]`` (the output gate's logits),
    ``conv_weight [3P, W]``, ``A_log [H]``, ``dt_bias [P]``, ``norm_weight [D]``, ``conv_state
    [slots, 3P, W-1]``, ``rec_state [slots, H, D, D]`` fp32, ``slots [N]`` int32/int64.
    ``lower_bound``: K3's safe gate bound (negative), or None for Kimi Linear's softplus gate.
    """
    if qkv.dim() != 2:
        raise ValueError(f"kda_decode: qkv must be [N, 3P], got {tuple(qkv.shape)}")
    n = qkv.shape[0]
    if A_log.dim() != 1 or A_log.dtype != torch.float32 or not A_log.is_contiguous():
        raise ValueError(f"kda_decode: A_log must be contiguous fp32 [H], got {A_log.dtype} {tuple(A_log.shape)}")
    h = A_log.shape[0]
    d = norm_weight.shape[0] if norm_weight.dim() == 1 else 0
    p = h * d
    if not d or norm_weight.dtype not in FLOAT_DTYPES or not norm_weight.is_contiguous():
        raise ValueError(f"kda_decode: norm_weight must be contiguous float [D], got {tuple(norm_weight.shape)}")
    _rows("qkv", qkv, n, 3 * p)
    _rows("f_b", f_b, n, p)
    _rows("b", b, n, h)
    _rows("gate", gate, n, p)
    if (
        conv_weight.dim() != 2
        or conv_weight.shape[0] != 3 * p
        or conv_weight.shape[1] < 2
        or conv_weight.dtype != torch.float32
        or conv_weight.stride(-1) != 1
    ):
        raise ValueError(
            f"kda_decode: conv_weight must be fp32 [3P={3 * p}, W >= 2] with a contiguous last dim, "
            f"got {conv_weight.dtype} {tuple(conv_weight.shape)}"
        )
    w = conv_weight.shape[1]
    if dt_bias.shape != (p,) or dt_bias.dtype != torch.float32 or not dt_bias.is_contiguous():
        raise ValueError(
            f"kda_decode: dt_bias must be contiguous fp32 [P={p}], got {dt_bias.dtype} {tuple(dt_bias.shape)}"
        )
    if (
        conv_state.dim() != 3
        or conv_state.shape[1:] != (3 * p, w - 1)
        or conv_state.dtype not in FLOAT_DTYPES
        or conv_state.stride(-1) != 1
    ):
        raise ValueError(
            f"kda_decode: conv_state must be float [slots, 3P={3 * p}, W-1={w - 1}] with a contiguous last "
            f"dim, got {conv_state.dtype} {tuple(conv_state.shape)}"
        )
    if (
        rec_state.dim() != 4
        or rec_state.shape[1:] != (h, d, d)
        or rec_state.dtype != torch.float32
        or rec_state.stride(-1) != 1
        or rec_state.shape[0] != conv_state.shape[0]
    ):
        raise ValueError(
            f"kda_decode: rec_state must be fp32 [slots={conv_state.shape[0]}, H={h}, D={d}, D={d}] with a "
            f"contiguous last dim, got {rec_state.dtype} {tuple(rec_state.shape)}"
        )
    if slots.shape != (n,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kda_decode: slots must be int32/int64 [N={n}], got {slots.dtype} {tuple(slots.shape)}")
    if lower_bound is not None and lower_bound >= 0:
        raise ValueError(f"kda_decode: lower_bound must be negative (a log-decay), got {lower_bound}")
    out = torch.empty((n, p), dtype=qkv.dtype, device=qkv.device)
    check_device(qkv, f_b, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_state, rec_state, slots, out)
    if n and h:
        block_d = triton.next_power_of_2(d)
        _kda_decode_kernel[(n, h)](
            qkv,
            f_b,
            b,
            gate,
            conv_weight,
            A_log,
            dt_bias,
            norm_weight,
            conv_state,
            rec_state,
            slots,
            out,
            h,
            d,
            p,
            rec_state.shape[0],
            qkv.stride(0),
            f_b.stride(0),
            b.stride(0),
            gate.stride(0),
            conv_weight.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            rec_state.stride(0),
            rec_state.stride(1),
            rec_state.stride(2),
            out.stride(0),
            scale,
            eps,
            0.0 if lower_bound is None else float(lower_bound),
            W=w,
            BLOCK_D=block_d,
            BLOCK_V=min(block_d, 32),
            BLOCK_W=triton.next_power_of_2(w),
            SAFE_GATE=lower_bound is not None,
            num_warps=4,
        )
    return out
