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
The routed experts take the model's activation (K3: SiTU) from the config, like the shared experts
(``RoutedExperts``): device and host stacks compute it in their fused kernels.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.activation import GatedActivation
from kimitui.engine.layers.linear import Linear
from kimitui.engine.layers.mlp import MLP
from kimitui.engine.layers.moe import RoutedExperts
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.layers.router import Router
from kimitui.engine.parallel.state import SINGLE, ParallelState


class KimiMoE(nn.Module):
    # the latent projections and norm: dense per-layer weights like the shared experts (the router
    # and the routed experts declare their own class)
    param_class = "shared_experts"

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        par: ParallelState = SINGLE,
        placement_row: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        c = config
        self.par = par
        self.act = GatedActivation.from_config(c)
        self.gate = Router(c)
        latent = c.routed_expert_hidden_size
        self.latent = latent
        if latent is not None:
            self.routed_expert_down_proj = Linear(
                c.hidden_size, latent, None, f"{prefix}.routed_expert_down_proj", dtype=dtype
            )
            # Row parallel over the latent dim: every rank holds the whole reduced, normed y and
            # multiplies its slice, so the caller's all-reduce sums the ranks' parts once.
            self.l0, self.l1 = par.range(latent) if par.is_parallel else (0, latent)
            shard = (1, self.l0, self.l1) if par.is_parallel else None
            self.routed_expert_up_proj = Linear(
                latent, c.hidden_size, None, f"{prefix}.routed_expert_up_proj", shard, dtype
            )
            self.routed_expert_norm = RMSNorm(latent, c.rms_norm_eps, dtype) if c.latent_moe_use_norm else None
        # The experts see width L: the same stacks as DeepSeek-V3's, built for hidden_size = L.
        expert_cfg = c if latent is None else dataclasses.replace(c, hidden_size=latent)
        self.experts = RoutedExperts(expert_cfg, f"{prefix}.experts", par, placement_row, dtype)
        # the whole module in one call where the backend offers it (Backend.fuse_latent_moe, asked
        # once after loading); None: op by op
        self.fused = None
        self.shared_experts = None
        if c.n_shared_experts:
            self.shared_experts = MLP(
                c.hidden_size,
                c.moe_intermediate_size * c.n_shared_experts,
                c.quantization,
                f"{prefix}.shared_experts",
                par,
                dtype,
                "shared_experts",
                self.act,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [T, D]; the caller reduces over ranks."""
        fused = self.fused
        if fused is not None and fused.takes(x):  # the backend's one call (a few rows on a CPU)
            return fused(x)
        # the routing statistics in the router's launch (skipping a decode graph's padding rows)
        experts = self.experts
        # the weights rounded to the experts' dtype in the router's launch too (not a cast of its own)
        topk_ids, topk_weights = self.gate(x, experts.routing_counts, x.dtype, count_rows=experts.count_rows)
        z = x if self.latent is None else self.routed_expert_down_proj(x)  # [T, L]
        # the shared experts need no host result: enqueued before the host experts' join (the latent
        # up-projection does: the norm between makes it a function of the joined sum)
        shared = []
        hook = (lambda: shared.append(self.shared_experts(x))) if self.shared_experts is not None else None
        y = experts(z, topk_ids, topk_weights, counted=True, before_join=hook)  # SiTU in the kernels' epilogue
        if self.latent is not None:
            y = self.par.all_reduce(y)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y[:, self.l0 : self.l1] if self.par.is_parallel else y)
        if shared:
            y = y + shared[0]
        return y
