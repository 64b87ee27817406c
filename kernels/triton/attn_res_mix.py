"""Kimi K3's AttnRes mix and the RMSNorm after it in one Triton launch (reference:
``Backend.attn_res_mix_norm``, i.e. ``reference.attn_res_mix`` then ``reference.rms_norm``).

Before each sublayer K3 replaces the residual stream by a softmax mix of the earlier block sums and
the current one (``engine/layers/attn_res.py``), then normalises it. Op by op a mix is a stack, an
fp32 cast, an RMS norm of every candidate, the score product, a softmax, the weighted sum and a cast
(about fourteen launches), the norm after it about three, and the residual add in front of the MLP
mix one more. Here one program per token row streams the candidates once with an online softmax
(running max and sum, as flash attention), optionally adds the attention output to the running sum
first (and writes that sum, the next residual), optionally keeps the incoming sum as the next block
snapshot (a row of the snapshot buffer), and writes the normed mix.

Numerics follow the PyTorch path: the sum rounds to the activation dtype; scores, softmax and the
weighted sum in fp32, the mix rounded to the activation dtype; then Hugging Face's RMSNorm (fp32
statistics, rounded before the weight multiply, output in torch's promotion of weight and input).
The online softmax sums in another order than ``torch.softmax``: equal within fp32 rounding.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device

_MAX_BLOCK = 65536  # one row in one block: 7168 (K3's hidden size) pads to 8192


@triton.jit
def _score(v, q, D, eps):
    # sum_d rmsnorm(v)[d] * q[d]: the candidate's logit (q: the norm weight folded into the query)
    return tl.sum(v * q, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)


@triton.jit
def _attn_res_mix_norm_kernel(
    x_ptr,
    delta_ptr,
    blocks_ptr,
    rw_ptr,
    pw_ptr,
    nw_ptr,
    out_ptr,
    s_ptr,
    N,
    D,
    stride_x,
    stride_delta,
    stride_bn,
    stride_bt,
    stride_out,
    stride_s,
    res_eps,
    norm_eps,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    SAVE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    act = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0)
    if HAS_DELTA:  # the running sum plus the attention output, rounded: the next residual
        s = (s.to(tl.float32) + tl.load(delta_ptr + t * stride_delta + offs, mask=m, other=0.0).to(tl.float32)).to(act)
        tl.store(s_ptr + t * stride_s + offs, s, mask=m)
    s = s.to(tl.float32)
    if SAVE:  # the incoming sum becomes block N (the caller's buffer has room for it)
        n64 = N + tl.zeros((1,), dtype=tl.int64)  # block N's offset in int64: N * T * D passes 2**31 for long steps
        tl.store(blocks_ptr + n64 * stride_bn + t * stride_bt + offs, s.to(blocks_ptr.dtype.element_ty), mask=m)
    q = tl.load(rw_ptr + offs, mask=m, other=0.0).to(tl.float32) * tl.load(pw_ptr + offs, mask=m, other=0.0).to(
        tl.float32
    )
    # online softmax over blocks[0..N) and s; s first (any order gives the same softmax)
    run_max = _score(s, q, D, res_eps)
    run_sum = run_max * 0.0 + 1.0
    acc = s
    v_ptrs = blocks_ptr + t * stride_bt + offs  # block i's row: the pointer steps by the stride (64-bit)
    for i in range(0, N):
        v = tl.load(v_ptrs, mask=m, other=0.0).to(tl.float32)
        v_ptrs += stride_bn
        sc = _score(v, q, D, res_eps)
        new_max = tl.maximum(run_max, sc)
        alpha = tl.exp(run_max - new_max)
        p = tl.exp(sc - new_max)
        acc = acc * alpha + p * v
        run_sum = run_sum * alpha + p
        run_max = new_max
    h = (acc / run_sum).to(act).to(tl.float32)
    # Hugging Face RMSNorm of the mix
    h = (h * tl.rsqrt(tl.sum(h * h, axis=0) / D + norm_eps)).to(act).to(tl.float32)
    w = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, (h * w).to(out_ptr.dtype.element_ty), mask=m)


def _vector(name: str, t: torch.Tensor, d: int) -> None:
    if t.reshape(-1).shape != (d,) or t.dtype not in FLOAT_DTYPES or not t.is_contiguous():
        raise ValueError(
            f"attn_res_mix_norm: {name} must be contiguous float with {d} entries, got {t.dtype} {tuple(t.shape)}"
        )


def attn_res_mix_norm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    res_norm_weight: torch.Tensor,
    res_eps: float,
    proj_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    delta: torch.Tensor | None = None,
    save: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(mix(s, blocks[:n])) * norm_weight, s)`` with ``s = x + delta`` (rounded to x.dtype;
    ``s = x`` when delta is None), ``mix`` the AttnRes softmax mix of ``blocks[:n] + [s]``
    (``reference.attn_res_mix``; just ``s`` when n is 0). ``save``: also write ``s`` to ``blocks[n]``.

    ``x``, ``delta [T, D]`` (contiguous last dim); ``blocks [>= n (+1 with save), T, D]`` in x.dtype
    (the snapshot buffer; contiguous last dim); ``res_norm_weight``, ``proj_weight`` (``[1, D]`` or
    ``[D]``) and ``norm_weight``: D entries each.
    """
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(-1) != 1:
        raise ValueError(
            f"attn_res_mix_norm: x must be fp16/bf16/fp32 [T, D] with a contiguous last dim, "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    t, d = x.shape
    if triton.next_power_of_2(d) > _MAX_BLOCK:
        raise ValueError(f"attn_res_mix_norm: hidden size {d} is larger than one block ({_MAX_BLOCK})")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or delta.stride(-1) != 1):
        raise ValueError(
            f"attn_res_mix_norm: delta must be {x.dtype} {tuple(x.shape)} with a contiguous last dim, "
            f"got {delta.dtype} {tuple(delta.shape)}"
        )
    need = n + 1 if save else n
    if (
        blocks.dim() != 3
        or blocks.shape[1:] != (t, d)
        or blocks.shape[0] < need
        or blocks.dtype != x.dtype
        or blocks.stride(-1) != 1
        or n < 0
    ):
        raise ValueError(
            f"attn_res_mix_norm: blocks must be {x.dtype} [>= {need}, T={t}, D={d}] with a contiguous "
            f"last dim (n = {n}), got {blocks.dtype} {tuple(blocks.shape)}"
        )
    for name, w in (("res_norm_weight", res_norm_weight), ("proj_weight", proj_weight), ("norm_weight", norm_weight)):
        _vector(name, w, d)
    out = torch.empty((t, d), dtype=torch.promote_types(norm_weight.dtype, x.dtype), device=x.device)
    s = x if delta is None else torch.empty_like(x)
    check_device(x, blocks, res_norm_weight, proj_weight, norm_weight, out, *([] if delta is None else [delta]))
    if t:
        dl = x if delta is None else delta  # a dummy pointer when there is no delta, never read
        _attn_res_mix_norm_kernel[(t,)](
            x,
            dl,
            blocks,
            res_norm_weight,
            proj_weight,
            norm_weight,
            out,
            s,
            n,
            d,
            x.stride(0),
            dl.stride(0),
            blocks.stride(0),
            blocks.stride(1),
            out.stride(0),
            s.stride(0),
            res_eps,
            norm_eps,
            BLOCK=triton.next_power_of_2(d),
            HAS_DELTA=delta is not None,
            SAVE=save,
            num_warps=8 if d >= 4096 else 4,
        )
    return out, s
