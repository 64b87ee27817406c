"""Mixture of experts: sigmoid noaux_tc router, routed experts stacked per format, shared experts."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.linear import linear_format, quantized_params
from engine.layers.mlp import MLP
from kernels import dispatch


class Router(nn.Module):
    """Group-limited top-k over sigmoid scores; the correction bias steers selection only."""

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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // self.n_group, dim=1), float("-inf"))
        topk_ids = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return topk_ids, weights * self.scaling


class RoutedExperts(nn.Module):
    """All routed experts of one layer as stacked tensors (gate and up fused as w13).

    Checkpoint tensors ``experts.E.{gate,up,down}_proj.<suffix>`` land in ``w13_<suffix>[E]``
    (gate rows first, then up) or ``w2_<suffix>[E]``; see ``load_expert_tensor``.
    """

    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__()
        c = config
        self.num_experts, self.hidden, self.inter = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.quant = c.quantization
        self.fmt = linear_format(self.quant, f"{prefix}.0.gate_proj")
        e = (self.num_experts,)
        for name, t in quantized_params(self.fmt, 2 * self.inter, self.hidden, self.quant, e).items():
            if name == "weight_scale_inv" and self.inter % self.quant.weight_block_size[0]:
                # gate and up are stacked into w13; their scale blocks only line up on block boundaries
                raise ValueError(f"FP8 experts need moe_intermediate_size ({self.inter}) divisible by the "
                                 f"weight block ({self.quant.weight_block_size[0]})")
            self.register_parameter(f"w13_{name}", nn.Parameter(t, requires_grad=False))
        for name, t in quantized_params(self.fmt, self.hidden, self.inter, self.quant, e).items():
            self.register_parameter(f"w2_{name}", nn.Parameter(t, requires_grad=False))

    def load_expert_tensor(self, expert: int, proj: str, suffix: str, tensor: torch.Tensor) -> str | None:
        """Copy one checkpoint tensor into the stack; returns an error string on shape mismatch."""
        if suffix == "weight_shape":
            return None  # redundant with the config; shapes are checked on the packed tensors
        stack = "w2" if proj == "down_proj" else "w13"
        param = getattr(self, f"{stack}_{suffix}", None)
        if param is None:
            return f"unexpected tensor kind '{suffix}' for {self.fmt} experts"
        dst = param.data[expert]
        if stack == "w13":
            half = dst.shape[0] // 2
            dst = dst[:half] if proj == "gate_proj" else dst[half:]
        if tuple(dst.shape) != tuple(tensor.shape):
            return f"shape {list(tensor.shape)} != expected {list(dst.shape)}"
        dst.copy_(tensor)
        return None

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        w = topk_weights.to(x.dtype)
        if self.fmt == "dense":
            return dispatch.moe_experts(x, topk_ids, w, self.w13_weight, self.w2_weight)
        if self.fmt == "int4":
            return dispatch.moe_experts_w4a16(x, topk_ids, w, self.w13_weight_packed, self.w13_weight_scale,
                                              self.w2_weight_packed, self.w2_weight_scale, self.quant.group_size)
        if self.fmt == "mxfp4":
            return dispatch.moe_experts_mxfp4(x, topk_ids, w, self.w13_weight_packed, self.w13_weight_scale,
                                              self.w2_weight_packed, self.w2_weight_scale)
        return dispatch.moe_experts_fp8(x, topk_ids, w, self.w13_weight, self.w13_weight_scale_inv,
                                        self.w2_weight, self.w2_weight_scale_inv, self.quant.weight_block_size)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__()
        self.gate = Router(config)
        self.experts = RoutedExperts(config, f"{prefix}.experts")
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                      config.quantization, f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        y = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
