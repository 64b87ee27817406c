"""An output gate ``x * sigmoid(gate)`` in one Triton launch (reference: ``Backend.sigmoid_gate``).

Kimi K3's MLA multiplies its attention output by sigmoid(g_proj(x)) per channel before o_proj
(``engine/layers/mla.py``): op by op a sigmoid and a multiply, two launches each reading and writing
[T, H * v]. Here one program per (row, column block) reads both once. Numerics as the two PyTorch
ops: the sigmoid rounds to the activation dtype before the multiply.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, N, stride_x, stride_g, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g).to(g_ptr.dtype.element_ty).to(tl.float32)  # torch.sigmoid's rounding
    tl.store(out_ptr + row * stride_out + offs, (x * sig).to(out_ptr.dtype.element_ty), mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` for ``x, gate [T, N]`` of one dtype (rows may be strided, the last dim
    contiguous) -> [T, N] in x.dtype."""
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(-1) != 1:
        raise ValueError(
            f"sigmoid_gate: x must be fp16/bf16/fp32 [T, N] with a contiguous last dim, got {x.dtype} {tuple(x.shape)}"
        )
    if gate.shape != x.shape or gate.dtype != x.dtype or gate.stride(-1) != 1:
        raise ValueError(
            f"sigmoid_gate: gate must be {x.dtype} {tuple(x.shape)} with a contiguous last dim, "
            f"got {gate.dtype} {tuple(gate.shape)}"
        )
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    check_device(x, gate, out)
    if t and n:
        block = min(1024, triton.next_power_of_2(n))
        _sigmoid_gate_kernel[(t, triton.cdiv(n, block))](
            x, gate, out, n, x.stride(0), gate.stride(0), out.stride(0), BLOCK=block
        )
    return out
