"""SwiGLU MLP: the dense first layers and the shared experts (tensor parallel over the
intermediate dim; the output is this rank's partial sum, reduced by the caller)."""

from __future__ import annotations

import torch
from torch import nn

from kimitui.engine.config import QuantConfig
from kimitui.engine.layers.activation import GatedActivation
from kimitui.engine.layers.linear import Linear, fuse_dense_rows, linear_format, split_unit
from kimitui.engine.parallel.state import SINGLE, ParallelState
from kimitui.kernels.backend import REFERENCE, Backend


class MLP(nn.Module):
    ops: Backend = REFERENCE  # the model's backend, set when it is loaded

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        quant: QuantConfig | None,
        prefix: str,
        par: ParallelState = SINGLE,
        dtype: torch.dtype = torch.float32,
        param_class: str = "dense_mlp",
        act: GatedActivation | None = None,
    ):
        super().__init__()
        self.param_class = param_class  # "dense_mlp" or "shared_experts", for the planner
        self.parallel = par.is_parallel
        self.act = act or GatedActivation()  # SiLU unless the model says otherwise (K3: SiTU)
        cols = rows = None
        if par.is_parallel:
            # whole FP8 blocks / INT4 groups per rank, so gate/up rows and down columns split alike
            unit = max(split_unit(linear_format(quant, f"{prefix}.{n}"), quant) for n in ("gate_proj", "down_proj"))
            start, end = par.range(intermediate_size, unit)
            cols, rows = (0, start, end), (1, start, end)
        self.gate_proj = Linear(hidden_size, intermediate_size, quant, f"{prefix}.gate_proj", cols, dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, quant, f"{prefix}.up_proj", cols, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, quant, f"{prefix}.down_proj", rows, dtype)
        self.register_buffer("gate_up", None, persistent=False)  # [2I, D] when dense, set by post_load

    def post_load(self) -> None:
        """Once the weights are in: dense gate and up become one product (rows of one weight)."""
        self.gate_up = fuse_dense_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.ops.gated_act(self.ops.linear(x, self.gate_up), self.act))
