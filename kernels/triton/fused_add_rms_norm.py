"""Residual add + RMSNorm in one Triton launch (reference: ``reference.fused_add_rms_norm``).

A decoder layer normalises ``x + residual`` twice per layer (before attention, before the MLP) and
keeps the sum as the next residual. Op by op that is an add, a cast, a square, a mean, an rsqrt, two
multiplies and casts: about eight launches, each reading the whole hidden state. Here one program
per row loads both inputs once, writes the sum and the normalised row.

Numerics follow Hugging Face (``DeepseekV3RMSNorm`` after ``hidden_states + residual``): the sum is
rounded to the activation dtype first (it is the residual the next layer adds to), the norm runs in
fp32 on that rounded sum, the normalised row is rounded to the activation dtype, then multiplied by
the weight. Same structure as AITER's ``_fused_add_rmsnorm_kernel`` (ROCm/aiter,
``aiter/ops/triton/_triton_kernels/normalization/rmsnorm.py``), with one block per row.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device

_MAX_BLOCK = 65536  # one row in one block: 7168 (Kimi K2) pads to 8192


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    rout_ptr,
    o32_ptr,
    H,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    stride_o32,
    eps,
    BLOCK: tl.constexpr,
    HAS_OUT32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
    # the sum rounds to the residual dtype: it is what the next layer adds to
    s = (x.to(tl.float32) + r.to(tl.float32)).to(rout_ptr.dtype.element_ty)  # [H]
    tl.store(rout_ptr + row * stride_ro + offs, s, mask=mask)
    sf = s.to(tl.float32)
    h = sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    h = h.to(rout_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight multiply
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (h * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    if HAS_OUT32:  # the same values upcast (exact): the MoE router's fp32 input, without a cast launch
        tl.store(o32_ptr + row * stride_o32 + offs, y.to(tl.float32), mask=mask)


def _rows(t: torch.Tensor, name: str, h: int) -> torch.Tensor:
    rows = t.reshape(-1, h)
    if rows.stride(-1) != 1:
        raise ValueError(f"fused_add_rms_norm: {name} must have a contiguous last dim, got strides {t.stride()}")
    return rows


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` for ``x, residual [..., H]``, one launch.

    The sum has x's dtype; the normalised output has torch's promotion of (weight, x), as HF.
    ``out`` / ``residual_out`` are written in place when given (persistent decode buffers; passing
    ``residual_out=residual`` updates the residual stream in place, as vLLM's fused_add_rms_norm).
    ``out32``: None, or an fp32 tensor of x's shape that also receives the normalised output (exactly
    ``out.float()``, in the same launch).
    """
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"fused_add_rms_norm: {name} must be fp16/bf16/fp32, got {t.dtype}")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"fused_add_rms_norm: residual must be {x.dtype} {tuple(x.shape)}, "
            f"got {residual.dtype} {tuple(residual.shape)}"
        )
    h = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != h or not weight.is_contiguous():
        raise ValueError(f"fused_add_rms_norm: weight must be contiguous [H={h}], got {tuple(weight.shape)}")
    if triton.next_power_of_2(h) > _MAX_BLOCK:
        raise ValueError(f"fused_add_rms_norm: hidden size {h} is larger than one block ({_MAX_BLOCK})")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty_like(x)
    for name, t, dtype in (("out", out, out_dtype), ("residual_out", residual_out, x.dtype)):
        if t.shape != x.shape or t.dtype != dtype:
            raise ValueError(
                f"fused_add_rms_norm: {name} must be {dtype} {tuple(x.shape)}, got {t.dtype} {tuple(t.shape)}"
            )
    if out32 is not None and (out32.shape != x.shape or out32.dtype != torch.float32):
        raise ValueError(
            f"fused_add_rms_norm: out32 must be torch.float32 {tuple(x.shape)}, got {out32.dtype} {tuple(out32.shape)}"
        )
    check_device(x, residual, weight, out, residual_out, *([] if out32 is None else [out32]))

    xr, rr = _rows(x, "x", h), _rows(residual, "residual", h)  # [R, H]
    orows, rorows = _rows(out, "out", h), _rows(residual_out, "residual_out", h)
    o32rows = orows if out32 is None else _rows(out32, "out32", h)  # orows: a dummy pointer, never written
    pairs = [(orows, out), (rorows, residual_out)] + ([] if out32 is None else [(o32rows, out32)])
    if not all(_same_storage(v, t) for v, t in pairs):
        raise ValueError("fused_add_rms_norm: out, residual_out and out32 must be viewable as [rows, H] without a copy")
    block = triton.next_power_of_2(h)
    if xr.shape[0]:
        _fused_add_rms_norm_kernel[(xr.shape[0],)](
            xr,
            rr,
            weight,
            orows,
            rorows,
            o32rows,
            h,
            xr.stride(0),
            rr.stride(0),
            orows.stride(0),
            rorows.stride(0),
            o32rows.stride(0),
            eps,
            BLOCK=block,
            HAS_OUT32=out32 is not None,
            num_warps=8 if block >= 4096 else 4,
        )
    return out, residual_out


def _same_storage(view: torch.Tensor, t: torch.Tensor) -> bool:
    # reshape copies when it cannot view: the kernel would then write into a temporary
    return view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
