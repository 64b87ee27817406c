"""RMSNorm as Hugging Face computes it for DeepSeek-V3."""

from __future__ import annotations

import torch
from torch import nn

from kimitui.kernels.backend import REFERENCE, Backend


class RMSNorm(nn.Module):
    ops: Backend = REFERENCE  # the model's backend, set when it is loaded

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one backend call (one launch on a device). ``x``
        must be a fresh tensor the caller gives up: it may hold the sum."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def add_forward_fp32(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``add_forward`` and the normalised output's fp32 copy (exact) from the same call: the input
        of a MoE router, which computes in fp32."""
        return self.ops.add_rms_norm_fp32(x, residual, self.weight, self.eps)
