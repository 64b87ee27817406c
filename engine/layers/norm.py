"""RMSNorm as Hugging Face computes it for DeepSeek-V3."""

from __future__ import annotations

import torch
from torch import nn

from kernels import dispatch, reference


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On a CPU, dispatch picks the C++ kernel for fp32 when it is built, else the reference. On a
        # device the reference's PyTorch ops run (the Triton rms_norm is not used by the model).
        if x.device.type == "cpu":
            return dispatch.rms_norm(x, self.weight, self.eps)
        return reference.rms_norm(x, self.weight, self.eps)
