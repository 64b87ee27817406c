"""SwiGLU MLP: the dense first layers and the shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QuantConfig
from engine.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant: QuantConfig | None, prefix: str):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, quant, f"{prefix}.gate_proj")
        self.up_proj = Linear(hidden_size, intermediate_size, quant, f"{prefix}.up_proj")
        self.down_proj = Linear(intermediate_size, hidden_size, quant, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
