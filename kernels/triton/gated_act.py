"""The gated activation of a dense MLP, ``act(gate) * up``, in one Triton launch (reference:
``engine.layers.activation.GatedActivation``).

The dense MLP and the shared experts compute gate and up as one product ``gu [T, 2I]`` (gate
columns first); op by op the activation is a SiLU and a multiply (two launches, each reading and
writing [T, I]). Here one program per (row, column block) reads both halves once and writes the
result, as vLLM's ``silu_and_mul``.

Numerics follow the PyTorch forms exactly: SiLU rounds ``silu(gate)`` to the activation dtype before
the multiply (``F.silu(gate) * up``: two ops, two roundings); SiTU computes in fp32 and rounds once
(``situ_and_mul``). Triton has no portable tanh (CUDA and ROCm expose it only through their own
libdevice), so SiTU's tanh is ``1 - 2 / (exp(2x) + 1)``, within fp32 rounding of ``torch.tanh``.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device

SILU, SITU = 0, 1


@triton.jit
def _tanh(x):
    # saturates cleanly: exp overflows to inf for large x (-> 1), underflows to 0 for very negative x (-> -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _gated_act_kernel(
    gu_ptr,
    out_ptr,
    I,
    stride_g,
    stride_o,
    beta,
    linear_beta,
    ACT: tl.constexpr,
    BOUND_UP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + I + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # SiLU, rounded to the activation dtype before the multiply (as F.silu(g) * u)
        a = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = a * u
    else:  # SiTU, all in fp32, one rounding
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
        if BOUND_UP:
            u = linear_beta * _tanh(u / linear_beta)
        y = a * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_act(
    gu: torch.Tensor, kind: str = "silu", beta: float = 1.0, linear_beta: float | None = None
) -> torch.Tensor:
    """``act(gu[..., :I]) * gu[..., I:]`` for ``gu [..., 2I]`` (rows may be strided, the last dim
    contiguous) -> ``[..., I]`` in gu.dtype. ``kind``: "silu" or "situ" (with ``beta``, ``linear_beta``)."""
    if gu.dim() < 1 or gu.dtype not in FLOAT_DTYPES or gu.shape[-1] % 2:
        raise ValueError(f"gated_act: gu must be fp16/bf16/fp32 [..., 2I], got {gu.dtype} {tuple(gu.shape)}")
    if kind not in ("silu", "situ"):
        raise ValueError(f"gated_act: kind must be silu or situ, got {kind!r}")
    if kind == "situ" and (beta <= 0 or (linear_beta is not None and linear_beta <= 0)):
        raise ValueError(f"gated_act: SiTU betas must be positive, got beta={beta}, linear_beta={linear_beta}")
    inter = gu.shape[-1] // 2
    rows = gu.reshape(-1, 2 * inter)  # a view for row-strided inputs
    if rows.shape[0] and rows.stride(-1) != 1:
        raise ValueError(f"gated_act: gu must have a contiguous last dim, got strides {gu.stride()}")
    out = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype, device=gu.device)
    orows = out.view(-1, inter)
    check_device(rows, orows)
    if rows.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _gated_act_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows,
            orows,
            inter,
            rows.stride(0),
            orows.stride(0),
            float(beta),
            float(linear_beta if linear_beta is not None else 1.0),
            ACT=SILU if kind == "silu" else SITU,
            BOUND_UP=linear_beta is not None,
            BLOCK=block,
        )
    return out
