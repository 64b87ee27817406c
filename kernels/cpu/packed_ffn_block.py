"""The FFN half of a decoder layer whose routed experts are the CPU's packed tiles (INT4 / MXFP4,
``kernels.cpu_quant_moe``), as one Python call with nothing between the kernels.

``x + MoE(post_attention_layernorm(x))`` is, op by op, the norm, the router (C++), the routed
experts (C++ over the tiles), the shared expert (two C++ products and the gated activation) and the
add; the module calls, dispatch checks and argument rebuilding around them cost a single-request
decode step of a 4-bit checkpoint about as much as the router and the norm together (issue 40's
profile: Python between the C++ calls was 10-15% of a K2-shaped INT4 step). ``PackedFfnBlock``
reads the layer's weights by name once, after loading, and calls the same backend operations in the
same order with the same arguments: the bits are those of the op-by-op layer (tested: same tokens
and log-probs, same routing counts).

Taken for decode-sized steps (up to ``cpu_few_rows.MAX_ROWS`` rows) of float32 or bf16 models on
one rank whose experts all sit in this process's one tiled stack; anything else runs op by op.
"""

from __future__ import annotations

import torch

from kimitui.kernels.cpu import few_rows as cpu_few_rows

DTYPES = (torch.float32, torch.bfloat16)


class PackedFfnBlock:
    """One layer's packed-expert FFN half; ``__call__(x)`` -> ``(y, x)``, the layer's residual form
    (the hidden state after the layer is ``y + x``, the next norm adds it)."""

    def __init__(self, norm, moe, backend):
        gate, experts, shared = moe.gate, moe.experts, moe.shared_experts
        stack = experts.local
        self.backend = backend
        self.norm_weight, self.norm_eps = norm.weight, norm.eps
        self.gate = gate
        self.route_args = (
            gate.weight,
            gate.e_score_correction_bias,
            gate.top_k,
            gate.n_group,
            gate.topk_group,
            gate.scoring_func,
            gate.norm_topk_prob,
            gate.scaling,
        )
        self.counts = experts.routing_counts
        self.experts = experts
        self.stack = stack
        self.stack_args = (stack.tiled_fmt, stack.w13_tiles, stack.w2_tiles, stack.inter)
        self.activation = stack.activation
        self.shared = shared
        self.shared_gate_up = None if shared is None else shared.gate_up
        self.shared_act = None if shared is None else shared.act
        self.shared_down = None if shared is None else shared.down_proj.weight

    @staticmethod
    def build(norm, moe, backend) -> PackedFfnBlock | None:
        """The block for ``norm`` (post-attention RMSNorm) and ``moe`` (a ``MoE``), or None unless the
        routed experts are one local tiled stack and the shared experts (if any) one dense product pair."""
        experts = getattr(moe, "experts", None)
        gate = getattr(moe, "gate", None)
        if experts is None or gate is None or getattr(moe, "parallel", False):
            return None
        stack = getattr(experts, "local", None)
        if not getattr(experts, "whole_layer_local", False) or stack is None or stack.fmt != "tiles":
            return None
        shared = moe.shared_experts
        if shared is not None and (shared.gate_up is None or shared.down_proj.fmt != "dense" or shared.parallel):
            return None
        return PackedFfnBlock(norm, moe, backend)

    def fusable(self, x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= cpu_few_rows.MAX_ROWS and x.dtype in DTYPES and self.experts.count_rows is None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.backend
        # RMSNorm.forward
        h = ops.rms_norm(x, self.norm_weight, self.norm_eps)
        # MoE.forward: the router on h's exact fp32 copy, weights rounded to h's dtype
        ids, w = ops.moe_route(h.float(), *self.route_args, counts=self.counts, weights_dtype=h.dtype)
        # RoutedExperts.forward (whole layer local, counted by the router) -> ExpertStack.forward ("tiles")
        if w.dtype != torch.float32:
            w = w.to(h.dtype)
        y = ops.moe_experts_tiled(h, ids, w, *self.stack_args, activation=self.activation)
        if self.shared is not None:  # MLP.forward, then the in-place add MoE.forward does
            s = ops.linear(ops.gated_act(ops.linear(h, self.shared_gate_up), self.shared_act), self.shared_down)
            y = y.add_(s)
        return y, x
