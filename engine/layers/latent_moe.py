"""Kimi Linear / Kimi K3 mixture of experts, optionally in a latent space (K3's "LatentMoE").

    ids, w = router(h)                       # full-width h, fp32 sigmoid noaux_tc routing
    z = routed_expert_down_proj(h)           # [T, L]  (K3: L = routed_expert_hidden_size 3584)
    y = sum_k w_k * expert_k(z)              # experts live at width L
    y = all_reduce(y)                        # over ranks BEFORE the norm: norm(sum) != sum(norm)
    y = routed_expert_norm(y)                # RMSNorm, rms_norm_eps, when latent_moe_use_norm
    out = routed_expert_up_proj(y) + shared_experts(h)

Without ``routed_expert_hidden_size`` (Kimi Linear) there is no down/up/norm and this is the
DeepSeek-V3 MoE. Sources: Kimi K3 tech report arXiv:2607.24653; SGLang
``python/sglang/srt/models/kimi_k3.py`` (``_reduce_latent``). The router and the latent projections
are never quantised (K3 stores them in bf16 although the quantization ignore list does not name them).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import GatedActivation
from engine.layers.linear import Linear
from engine.layers.mlp import MLP
from engine.layers.moe import ExpertStack, RoutedExperts, Router
from engine.layers.norm import RMSNorm
from engine.parallel.state import SINGLE, ParallelState
from kernels import reference


class KimiMoE(nn.Module):
    # the latent projections and norm: dense per-layer weights like the shared experts (the router
    # and the routed experts declare their own class)
    param_class = "shared_experts"

    def __init__(self, config: ModelConfig, prefix: str, par: ParallelState = SINGLE,
                 placement_row: list[int] | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        c = config
        self.par = par
        self.act = GatedActivation.from_config(c)
        self.gate = Router(c)
        latent = c.routed_expert_hidden_size
        self.latent = latent
        if latent is not None:
            self.routed_expert_down_proj = Linear(c.hidden_size, latent, None, f"{prefix}.routed_expert_down_proj",
                                                  dtype=dtype)
            # Row parallel over the latent dim: every rank holds the whole reduced, normed y and
            # multiplies its slice, so the caller's all-reduce sums the ranks' parts once.
            self.l0, self.l1 = par.range(latent) if par.is_parallel else (0, latent)
            shard = (1, self.l0, self.l1) if par.is_parallel else None
            self.routed_expert_up_proj = Linear(latent, c.hidden_size, None, f"{prefix}.routed_expert_up_proj", shard,
                                                dtype)
            self.routed_expert_norm = RMSNorm(latent, c.rms_norm_eps, dtype) if c.latent_moe_use_norm else None
        # The experts see width L: the same stacks as DeepSeek-V3's, built for hidden_size = L.
        expert_cfg = c if latent is None else dataclasses.replace(c, hidden_size=latent)
        self.experts = RoutedExperts(expert_cfg, f"{prefix}.experts", par, placement_row, dtype)
        self.shared_experts = None
        if c.n_shared_experts:
            self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, c.quantization,
                                      f"{prefix}.shared_experts", par, dtype, "shared_experts", self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [T, D]; the caller reduces over ranks."""
        topk_ids, topk_weights = self.gate(x)
        z = x if self.latent is None else self.routed_expert_down_proj(x)  # [T, L]
        if self.act.is_silu:
            y = self.experts(z, topk_ids, topk_weights)
        else:
            y = _routed_experts_act(self.experts, z, topk_ids, topk_weights, self.act)
        if self.latent is not None:
            y = self.par.all_reduce(y)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y[:, self.l0:self.l1] if self.par.is_parallel else y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def _routed_experts_act(experts: RoutedExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        act: GatedActivation) -> torch.Tensor:
    """This rank's routed-expert sum with a non-SiLU activation (SiTU), expert by expert.

    The fused MoE kernels compute SiLU only; until they take SiTU this runs each expert that got
    tokens once on its rows, dequantising its weights on the fly (packed storage stays packed).
    Host-RAM experts run here too, synchronously.
    """
    flat = topk_ids.reshape(-1)
    experts.routing_counts.index_add_(0, flat, torch.ones_like(flat, dtype=experts.routing_counts.dtype))
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for stack, emap in ((experts.local, experts.local_map), (experts.host, experts.host_map)):
        if stack is None:
            continue
        local = emap.to(topk_ids.device)[topk_ids]  # [T, k] slot in this stack or -1
        for e in torch.unique(local[local >= 0]).tolist():  # host sync per step: reference path
            tok, slot = torch.nonzero(local == e, as_tuple=True)
            w13, w2 = _expert_weights(stack, e, x.dtype)
            rows = x.index_select(0, tok).to(w13.device)
            gu = rows @ w13.T  # [c, 2I]
            i = gu.shape[-1] // 2
            y = (act(gu[:, :i], gu[:, i:]) @ w2.T).float().to(x.device)
            out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


def _expert_weights(stack: ExpertStack, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, D], w2 [D, I]) of slot ``e`` as dense matrices in ``dtype``."""
    if stack.fmt == "dense":
        return stack.w13_weight[e].to(dtype), stack.w2_weight[e].to(dtype)
    if stack.fmt == "mxfp4":
        return (reference.dequant_mxfp4(stack.w13_weight_packed[e], stack.w13_weight_scale[e], dtype),
                reference.dequant_mxfp4(stack.w2_weight_packed[e], stack.w2_weight_scale[e], dtype))
    if stack.fmt == "int4":
        g = stack.quant.group_size
        d, i = stack.w13_weight_packed.shape[-1] * 8, stack.w2_weight_packed.shape[-1] * 8
        return (reference.dequant_int4(stack.w13_weight_packed[e], stack.w13_weight_scale[e], d, g, dtype),
                reference.dequant_int4(stack.w2_weight_packed[e], stack.w2_weight_scale[e], i, g, dtype))
    if stack.fmt == "fp8":
        b = stack.quant.weight_block_size
        return (reference.dequant_fp8_block(stack.w13_weight[e], stack.w13_weight_scale_inv[e], b, dtype),
                reference.dequant_fp8_block(stack.w2_weight[e], stack.w2_weight_scale_inv[e], b, dtype))
    raise ValueError(f"SiTU experts in format {stack.fmt!r} are not supported")
