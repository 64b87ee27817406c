"""The MoE router: sigmoid (or softmax) scores, group-limited top-k with DeepSeek-V3's noaux_tc correction
bias, weights normalised and scaled; computed by the model's backend (``Backend.moe_route``)."""

from __future__ import annotations

import torch
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.kernels.backend import REFERENCE, Backend


class Router(nn.Module):
    """Group-limited top-k over sigmoid scores; the correction bias steers selection only."""

    ops: Backend = REFERENCE  # the model's backend, set when it is loaded
    param_class = "router"  # for the planner, see engine.registry

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.norm_topk_prob, self.scaling = c.norm_topk_prob, c.routed_scaling_factor
        self.scoring_func = c.scoring_func
        # Kept in fp32 whatever the model dtype: routing decisions are sensitive to rounding.
        f32 = torch.float32
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size, dtype=f32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(c.n_routed_experts, dtype=f32), requires_grad=False)
        self.e_score_correction_bias.optional = True  # old checkpoints leave the zero bias out

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | None = None,
        weights_dtype: torch.dtype | None = None,
        count_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``counts``: None, or the [E] routing statistics each chosen expert adds one to (in the
        router's launch), skipping the rows where ``count_rows`` (None: none) is 0; the weights come
        in fp32, or rounded to ``weights_dtype``."""
        # count_rows only when given: the call every eager step makes goes to backends without the argument too
        extra = {} if count_rows is None else {"count_rows": count_rows}
        return self.ops.moe_route(
            x,
            self.weight,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.scoring_func,
            self.norm_topk_prob,
            self.scaling,
            counts=counts,
            weights_dtype=weights_dtype,
            **extra,
        )
