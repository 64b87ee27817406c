"""RMSNorm as Hugging Face computes it for DeepSeek-V3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32:
            # fp32 on a CPU (where the cast below is a no-op): the C++ kernel when it is built, else
            # F.rms_norm, which runs these same operations in one call (bit-identical in fp32).
            if dispatch.use_cpu_few_rows(x, self.weight):
                return dispatch.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight multiply (HF convention).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
