"""The FFN half of a decoder layer whose routed experts are the CPU's packed tiles (INT4 / MXFP4,
``kernels.cpu_quant_moe``): one C++ call (``PackedFfnWeights``, the few-row extension's
``packed_ffn_block``), or one Python call with nothing between the kernels (``PackedFfnBlock``).

``PackedFfnWeights`` is the bf16 / float32 dense ``ffn_block`` (``kernels/cpu/decode_block.py``) with
the routed experts replaced by the packed-experts extension's MoE, called from C++ by pointer: norm,
router, shared expert and sums in float32, the output rounded to the model's dtype once (within bf16
rounding of the op-by-op layer, as the dense block). Per layer of a K2-shaped INT4 decode step it
drops about 0.3 ms of Python and ATen calls around the kernels (issue 40's profile: the MoE layers'
FFN half took 0.35 ms more than its kernels; the dense layer's C++ block 0.1 ms). Taken where the
shared expert is a SiLU MLP on one rank; ``PackedFfnBlock`` keeps everything else.

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

import functools
from dataclasses import dataclass

import torch

from kimitui.kernels.activation import resolve
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe

DTYPES = (torch.float32, torch.bfloat16)
ABSENT = torch.empty(0)  # an absent weight, for the C++ side (never written)


@dataclass(frozen=True, eq=False)
class PackedFfnWeights:
    """The fixed arguments of the C++ ``packed_ffn_block``, in its order; ``dtype`` (the model's, which
    chose the products) is not one of them."""

    norm: torch.Tensor  # post_attention_layernorm [D], float32
    norm_eps: float
    gate_up: torch.Tensor  # the shared experts' [2I_s, D] (gate rows, then up), or empty
    down: torch.Tensor  # [D, I_s], or empty
    router: torch.Tensor  # [E, D] float32
    bias: torch.Tensor  # e_score_correction_bias [E] float32
    top_k: int
    n_group: int
    topk_group: int
    sigmoid: bool
    norm_topk_prob: bool
    scaling: float
    w4a8: bool  # the routed experts' products: W4A8 (path an int8 path) or float (an instruction-set path)
    w13: torch.Tensor  # the tile layout, uint8 [E, bytes]
    w2: torch.Tensor
    inter: int
    mxfp4: bool
    path: int
    act: int  # 0 SiLU, 1 SiTU
    beta: float
    linear_beta: float  # 0: SiTU's up unbounded
    dtype: torch.dtype

    @functools.cached_property
    def kernel_args(self) -> tuple:
        """The fields in order, as the C++ function takes them (built once: this runs every step)."""
        return tuple(getattr(self, f) for f in self.__dataclass_fields__ if f != "dtype")


def f32_vector(t: torch.Tensor) -> torch.Tensor:
    """A small vector the kernels take as float32: itself, or a float32 copy made once at fuse time
    (exact from bf16)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def expert_fields(stack, activation, dtype: torch.dtype) -> dict:
    """A tiled expert stack's arguments as the C++ blocks take them (``w4a8`` .. ``linear_beta``, and the
    ``dtype`` that chose the products); ``activation`` None is SiLU."""
    act = resolve(activation)
    w4a8, path = cpu_quant_moe.fused_path(dtype)
    return dict(
        w4a8=w4a8,
        w13=stack.w13_tiles,
        w2=stack.w2_tiles,
        inter=int(stack.inter),
        mxfp4=stack.tiled_fmt == "mxfp4",
        path=path,
        act=act.code,
        beta=float(act.beta),
        linear_beta=0.0 if act.linear_beta is None else float(act.linear_beta),
        dtype=dtype,
    )


def dense_cpu(dtype, *tensors) -> bool:
    """Whether every tensor is a contiguous CPU tensor of ``dtype`` (what the C++ blocks read in place)."""
    return all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def router_fields(gate) -> dict:
    """A DeepSeek-V3 ``Router``'s arguments as the C++ blocks take them (``router`` .. ``scaling``); the
    weight and bias as float32 (cast once here: the router computes in float32)."""
    return dict(
        router=f32_vector(gate.weight),
        bias=f32_vector(gate.e_score_correction_bias),
        top_k=int(gate.top_k),
        n_group=int(gate.n_group),
        topk_group=int(gate.topk_group),
        sigmoid=gate.scoring_func == "sigmoid",
        norm_topk_prob=bool(gate.norm_topk_prob),
        scaling=float(gate.scaling),
    )


def packed_ffn_weights(norm, moe) -> PackedFfnWeights | None:
    """The C++ block's arguments for ``norm`` (post-attention RMSNorm) and ``moe`` (a ``MoE`` whose routed
    experts are one local tiled stack), or None where it cannot take them: no C++ kernels, shared experts
    that are not one dense SiLU MLP of the model's dtype on this rank, weights not CPU tensors."""
    if PackedFfnBlock.build(norm, moe, None) is None or not cpu_quant_moe.available():
        return None
    gate, stack, shared = moe.gate, moe.experts.local, moe.shared_experts
    dtype = norm.weight.dtype
    if dtype not in DTYPES:
        return None
    if shared is not None:
        act = getattr(shared, "act", None)
        if (act is not None and not act.is_silu) or not dense_cpu(dtype, shared.gate_up, shared.down_proj.weight):
            return None
    vectors = (norm.weight, gate.weight, gate.e_score_correction_bias)
    if any(t.device.type != "cpu" or t.dtype not in DTYPES for t in vectors):
        return None
    return PackedFfnWeights(
        norm=f32_vector(norm.weight),
        norm_eps=float(norm.eps),
        gate_up=ABSENT if shared is None else shared.gate_up,
        down=ABSENT if shared is None else shared.down_proj.weight,
        **router_fields(gate),
        **expert_fields(stack, stack.activation, dtype),
    )


@dataclass(frozen=True, eq=False)
class LatentMoeWeights:
    """The fixed arguments of the C++ ``latent_moe_block`` (Kimi Linear / K3's MoE,
    ``engine/layers/latent_moe.py``), in its order; ``dtype`` and ``experts`` are not among them."""

    router: torch.Tensor  # [E, D] float32
    bias: torch.Tensor  # [E] float32
    top_k: int
    n_group: int
    topk_group: int
    sigmoid: bool
    norm_topk_prob: bool
    scaling: float
    down: torch.Tensor  # routed_expert_down_proj [L, D], or empty (no latent space)
    norm: torch.Tensor  # routed_expert_norm [L] float32, or empty
    norm_eps: float
    up: torch.Tensor  # routed_expert_up_proj [D, L], or empty
    gate_up: torch.Tensor  # the shared experts' [2I_s, D], or empty
    shared_down: torch.Tensor  # [D, I_s], or empty
    w4a8: bool
    w13: torch.Tensor
    w2: torch.Tensor
    inter: int
    mxfp4: bool
    path: int
    act: int  # the routed and shared experts' gated activation: 0 SiLU, 1 SiTU
    beta: float
    linear_beta: float
    dtype: torch.dtype
    experts: object  # the RoutedExperts (their counts, count_rows)

    @functools.cached_property
    def kernel_args(self) -> tuple:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__ if f not in ("dtype", "experts"))

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x [T, D]`` goes through the block: 1 to ``MAX_ROWS`` rows of the weights' dtype,
        every row's routing counted (a decode graph's padding rows must not be)."""
        return 0 < x.shape[0] <= cpu_few_rows.MAX_ROWS and x.dtype is self.dtype and self.experts.count_rows is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_few_rows.latent_moe_block(x, self.experts.routing_counts, self)


def latent_moe_weights(moe) -> LatentMoeWeights | None:
    """The C++ block's arguments for a ``KimiMoE`` whose routed experts are one local tiled stack on one
    rank and whose latent projections and shared experts are dense CPU matrices of one dtype (float32
    or bf16), or None (the module then runs op by op)."""
    experts, gate, shared = moe.experts, moe.gate, moe.shared_experts
    stack = getattr(experts, "local", None)
    if (
        moe.par.is_parallel
        or not experts.whole_layer_local
        or stack is None
        or stack.fmt != "tiles"
        or not cpu_quant_moe.available()
    ):
        return None
    dtype = gate.weight.dtype if moe.latent is None else moe.routed_expert_down_proj.weight.dtype
    if dtype not in DTYPES:
        return None
    mats = []
    if moe.latent is not None:
        down, up = moe.routed_expert_down_proj, moe.routed_expert_up_proj
        if down.fmt != "dense" or up.fmt != "dense":
            return None
        mats += [down.weight, up.weight]
    if shared is not None:
        if shared.gate_up is None or shared.down_proj.fmt != "dense" or shared.parallel:
            return None
        mats += [shared.gate_up, shared.down_proj.weight]
    if not dense_cpu(dtype, *mats) or gate.weight.device.type != "cpu":
        return None
    act = moe.act
    if act.kind not in ("silu", "situ") or (stack.activation is not None and stack.activation.kind != act.kind):
        return None
    norm = moe.routed_expert_norm if moe.latent is not None else None
    return LatentMoeWeights(
        **router_fields(gate),
        down=ABSENT if moe.latent is None else moe.routed_expert_down_proj.weight,
        norm=ABSENT if norm is None else f32_vector(norm.weight),
        norm_eps=0.0 if norm is None else float(norm.eps),
        up=ABSENT if moe.latent is None else moe.routed_expert_up_proj.weight,
        gate_up=ABSENT if shared is None else shared.gate_up,
        shared_down=ABSENT if shared is None else shared.down_proj.weight,
        **expert_fields(stack, act, dtype),
        experts=experts,
    )


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
