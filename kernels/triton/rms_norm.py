"""RMSNorm in Triton, Hugging Face convention (reference: ``reference.rms_norm``).

Normalise in fp32, cast to the input dtype, then multiply by the weight: rounding to x.dtype
before the weight multiply is what HF ``DeepseekV3RMSNorm`` does, and it changes the last bit.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, interpreting


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # [H]
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., H]`` with ``weight [H]``.

    Output dtype follows torch promotion of (weight, x), as HF's ``weight * h.to(x.dtype)``.
    """
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and weight must be fp16/bf16/fp32, got {x.dtype} and {weight.dtype}")
    h = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != h:
        raise ValueError(f"weight must be [H={h}], got {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if x.device != weight.device:
        raise ValueError(f"x and weight must share a device, got {x.device} and {weight.device}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need a CUDA/ROCm tensor (or TRITON_INTERPRET=1), got {x.device}")
    block = triton.next_power_of_2(h)
    if block > 65536:
        raise ValueError(f"hidden size {h} is larger than one block (65536)")

    rows = x.reshape(-1, h)  # [R, H]; copies only if the last dim is strided
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            out,
            h,
            rows.stride(0),
            out.stride(0),
            eps,
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )
    return out.view(x.shape)
