"""Each half of a DeepSeek-V3 decoder layer as one C++ call, for a few float32 or bf16 rows on a CPU.

``attention``: ``x + o_proj(MLA(input_layernorm(x)))`` for a step of decodes (writes the newest
latents); ``ffn``: ``x + MoE or MLP(post_attention_layernorm(x))``. They chain the kernels the layer
calls one by one (``cpu_decode_block.cpp``), in the same order, so the results are bit for bit those
of the unfused layer (float32); what goes is the Python between the kernels.

A bf16 model fuses too: its matrices and latent cache stay bf16 (the kernels widen them in
registers, so a step reads half the bytes), while the few small vectors the kernels take as float32
(norm weights, rotary tables, the router's weight and bias) are cast once here, when the layer is
fused. Inside a block a bf16 model's activations are float32 and only the block's output is rounded
to bf16 (the exact-accumulation choice): its results are within bf16 rounding of the op-by-op bf16
layer, not bit-identical to it.

The CPU backend builds a ``FusedDecoderLayer`` once per layer after loading
(``CpuBackend.fuse_decoder_layer``), reading the layer's weights by name into one dataclass per
half; a half whose weights the kernels cannot take (quantised, sharded, not contiguous float32 or
bf16 CPU tensors) stays None and runs op by op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kimitui.kernels.backend import written_rows
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu.linear import onednn_bf16_native
from kimitui.kernels.cpu.packed_ffn_block import (
    ABSENT,
    DTYPES,
    PackedFfnBlock,
    PackedFfnWeights,
    f32_vector,
    packed_ffn_weights,
    router_fields,
)


def _dense(*tensors: torch.Tensor) -> bool:
    # contiguous CPU tensors of one dtype the kernels read (float32 or bf16)
    return (
        len({t.dtype for t in tensors}) == 1
        and tensors[0].dtype in DTYPES
        and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    )


def block_rows(x: torch.Tensor) -> bool:
    """Whether a step's ``x [T, D]`` has a row count the decode blocks take: 1 to ``MAX_ROWS`` rows,
    or up to ``MAX_BF16_BLOCK_ROWS`` bf16 rows where oneDNN has a native bf16 product (the blocks'
    products then run oneDNN on packed weights)."""
    t = x.shape[0]
    if t <= cpu_few_rows.MAX_ROWS:
        return t > 0
    return x.dtype is torch.bfloat16 and t <= cpu_few_rows.MAX_BF16_BLOCK_ROWS and onednn_bf16_native()


@dataclass(frozen=True, eq=False)
class AttentionBlockWeights:
    """The fixed arguments of ``attention_block``, in the C++ function's order."""

    norm: torch.Tensor  # input_layernorm [D]
    norm_eps: float
    in_proj: torch.Tensor  # q_a_proj (or q_proj) stacked on kv_a_proj_with_mqa [q_width + r + rope, D]
    q_width: int
    q_norm: torch.Tensor  # q_a_layernorm [q_lora_rank], or empty without a q LoRA
    q_norm_eps: float
    q_b: torch.Tensor  # q_b_proj [H * (nope + rope), q_lora_rank], or empty
    heads: int
    kv_norm: torch.Tensor  # kv_a_layernorm [r]
    kv_norm_eps: float
    cos: torch.Tensor  # rotary tables [P, rope / 2]
    sin: torch.Tensor
    w_uk: torch.Tensor  # [H, nope, r]
    w_uv: torch.Tensor  # [H, v, r]
    scale: float  # softmax scale
    o_proj: torch.Tensor  # [D, H * v]
    gate: torch.Tensor  # Kimi Linear / K3's output gate g_proj [H * v, D], or empty
    residual: bool  # x + the attention (DeepSeek-V3's half), or the attention alone (K3: x comes normed)

    @functools.cached_property
    def kernel_args(self) -> tuple:
        """The fields in order, as the C++ function takes them (built once: this runs every step)."""
        # not dataclasses.astuple, which deep-copies every tensor
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)


@dataclass(frozen=True, eq=False)
class FfnBlockWeights:
    """The fixed arguments of ``ffn_block``, in the C++ function's order: a dense SwiGLU MLP
    (``router`` empty), or a MoE: router, routed experts and the shared experts (when the model has
    them) as gate_up / down."""

    norm: torch.Tensor  # post_attention_layernorm [D]
    norm_eps: float
    gate_up: torch.Tensor  # [2I, D] (gate rows, then up), or empty
    down: torch.Tensor  # [D, I], or empty
    router: torch.Tensor  # [E, D], or empty for a dense MLP
    bias: torch.Tensor  # e_score_correction_bias [E]
    top_k: int
    n_group: int
    topk_group: int
    sigmoid: bool  # scoring_func == "sigmoid" (else softmax)
    norm_topk_prob: bool
    scaling: float
    w13: torch.Tensor  # routed experts [E, 2I, D]
    w2: torch.Tensor  # [E, D, I]

    @functools.cached_property
    def kernel_args(self) -> tuple:
        """The fields in order, as the C++ function takes them."""
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)


def attention_weights(norm, attn) -> AttentionBlockWeights | None:
    """``norm`` (the layer's input RMSNorm) and ``attn`` (its ``MLAttention``) by name, or None where
    the kernel cannot take them: quantised or sharded weights, or matrices that are not float32 or
    bf16 CPU tensors of one dtype. ``norm`` None: Kimi Linear / K3's form, normed rows in and the
    attention out (no residual), NoPE (no rotary tables) and the output gate where the layer has them."""
    q_b = getattr(attn, "q_b_proj", None)
    q_norm = getattr(attn, "q_a_layernorm", None)
    q_in = attn.q_proj if q_b is None else attn.q_a_proj
    gate = getattr(attn, "g_proj", None)
    if (
        attn.in_proj is None
        or attn.par.is_parallel
        or attn.o_proj.fmt != "dense"
        or (q_b is not None and q_b.fmt != "dense")
        or (gate is not None and (norm is not None or gate.fmt != "dense"))
    ):
        return None
    matrices = [attn.in_proj, attn.w_uk, attn.w_uv, attn.o_proj.weight]
    matrices += [m.weight for m in (q_b, gate) if m is not None]
    vectors = [attn.kv_a_layernorm.weight] + [n.weight for n in (norm, q_norm) if n is not None]
    if attn.rope is not None:
        vectors += [attn.rope.cos, attn.rope.sin]
    if not (_dense(*matrices) and all(t.device.type == "cpu" and t.dtype in DTYPES for t in vectors)):
        return None
    return AttentionBlockWeights(
        norm=ABSENT if norm is None else f32_vector(norm.weight),
        norm_eps=0.0 if norm is None else float(norm.eps),
        in_proj=attn.in_proj,
        q_width=int(q_in.out_features),
        q_norm=ABSENT if q_b is None else f32_vector(q_norm.weight),
        q_norm_eps=0.0 if q_b is None else float(q_norm.eps),
        q_b=ABSENT if q_b is None else q_b.weight,
        heads=int(attn.num_heads),
        kv_norm=f32_vector(attn.kv_a_layernorm.weight),
        kv_norm_eps=float(attn.kv_a_layernorm.eps),
        cos=ABSENT if attn.rope is None else f32_vector(attn.rope.cos),
        sin=ABSENT if attn.rope is None else f32_vector(attn.rope.sin),
        w_uk=attn.w_uk,
        w_uv=attn.w_uv,
        scale=float(attn.scale),
        o_proj=attn.o_proj.weight,
        gate=ABSENT if gate is None else gate.weight,
        residual=norm is not None,
    )


def _mlp_fusable(mlp) -> bool:
    # dense gate_up and down on one rank; the kernel computes SiLU only
    act = getattr(mlp, "act", None)
    return (
        mlp.gate_up is not None and mlp.down_proj.fmt == "dense" and not mlp.parallel and (act is None or act.is_silu)
    )


def ffn_weights(norm, ffn) -> FfnBlockWeights | None:
    """``norm`` (the post-attention RMSNorm) and ``ffn`` (an ``MLP``, or a ``MoE`` with ``gate``,
    ``experts`` and ``shared_experts``) by name, or None unless every matrix is a dense CPU tensor
    of one dtype, float32 or bf16, on this one rank (a MoE: every routed expert in this process's
    one stack). The norm weight and the router (weight and bias) go to the kernel as float32."""
    gate = getattr(ffn, "gate", None)
    if gate is None:  # a dense MLP
        if not (_mlp_fusable(ffn) and _dense(ffn.gate_up, ffn.down_proj.weight) and norm.weight.dtype in DTYPES):
            return None
        return FfnBlockWeights(
            norm=f32_vector(norm.weight),
            norm_eps=float(norm.eps),
            gate_up=ffn.gate_up,
            down=ffn.down_proj.weight,
            router=ABSENT,
            bias=ABSENT,
            top_k=0,
            n_group=1,
            topk_group=1,
            sigmoid=True,
            norm_topk_prob=True,
            scaling=1.0,
            w13=ABSENT,
            w2=ABSENT,
        )
    experts, shared = ffn.experts, ffn.shared_experts
    # the kernel's MoE runs SiLU experts only (its C++ moe() takes SiTU, ffn_block does not pass it)
    if (
        ffn.parallel
        or not experts.whole_layer_local
        or experts.local.fmt != "dense"
        or getattr(experts.local, "activation", None) is not None
    ):
        return None
    if shared is not None and not _mlp_fusable(shared):
        return None
    stack = experts.local
    matrices = [stack.w13_weight, stack.w2_weight]
    if shared is not None:
        matrices += [shared.gate_up, shared.down_proj.weight]
    vectors = [norm.weight, gate.weight, gate.e_score_correction_bias]
    if not (_dense(*matrices) and all(t.device.type == "cpu" and t.dtype in DTYPES for t in vectors)):
        return None
    return FfnBlockWeights(
        norm=f32_vector(norm.weight),
        norm_eps=float(norm.eps),
        gate_up=ABSENT if shared is None else shared.gate_up,
        down=ABSENT if shared is None else shared.down_proj.weight,
        **router_fields(gate),
        w13=stack.w13_weight,
        w2=stack.w2_weight,
    )


def attention_call(x: torch.Tensor, meta, cache: torch.Tensor, weights: AttentionBlockWeights) -> torch.Tensor:
    """``attention_block`` on a decode step's rows (every slot real): the step's positions, slots and
    tables from ``meta``, the paged latent ``cache [num_blocks, block_size, r + rope]``."""
    return cpu_few_rows.attention_block(
        x,
        meta.positions,
        meta.slot_mapping,
        cache.view(-1, cache.shape[-1]),
        meta.decode_block_tables,
        meta.decode_context_lens,
        meta.block_size,
        weights,
    )


class FusedDecoderLayer:
    """The fused halves of one decoder layer; either may be None (that half runs op by op)."""

    def __init__(
        self,
        attention: AttentionBlockWeights | None,
        ffn: FfnBlockWeights | PackedFfnWeights | None,
        routing_counts: torch.Tensor,
        backend,
        experts=None,
        packed_ffn=None,
    ):
        self.attention_weights = attention
        self.ffn_weights = ffn
        # the FFN half over packed (INT4 / MXFP4) experts without Python between the kernels
        # (kernels.cpu_packed_ffn_block), where ``ffn`` cannot take the layer; None: op by op
        self.packed_ffn = packed_ffn
        self.routing_counts = routing_counts  # [E] int64, the MoE's counts (empty for a dense MLP)
        self.experts = experts  # the MoE's RoutedExperts (None for a dense MLP), for its count_rows
        self.backend = backend  # the CpuBackend: its MoE scratch buffer and lock

    def attention_fusable(self, x: torch.Tensor, meta) -> bool:
        """Whether this step's ``x [T, D]`` goes through ``attention``: decodes only, every output
        wanted, float32 or bf16 rows as many as ``block_rows`` takes, a latent cache of the matrices' dtype."""
        return (
            self.attention_weights is not None and block_rows(x) and x.dtype in DTYPES and meta.decodes_only(x.shape[0])
        )

    def attention(self, x: torch.Tensor, meta, cache: torch.Tensor) -> torch.Tensor:
        """``x + o_proj(MLA(norm(x)))``; cache [num_blocks, block_size, r + rope]. A decode graph's
        padding rows (slot -1) keep ``x`` and write no cache slot."""
        rows = written_rows(meta.slot_mapping)
        if rows is not None:
            out = x.clone()
            if rows.numel():
                out[rows] = cpu_few_rows.attention_block(
                    x[rows],
                    meta.positions[rows],
                    meta.slot_mapping[rows],
                    cache.view(-1, cache.shape[-1]),
                    meta.decode_block_tables[rows],
                    meta.decode_context_lens[rows],
                    meta.block_size,
                    self.attention_weights,
                )
            return out
        return attention_call(x, meta, cache, self.attention_weights)

    def ffn_fusable(self, x: torch.Tensor) -> bool:
        """Whether this step's ``x [T, D]`` goes through ``ffn``: float32 or bf16 rows as many as ``block_rows``
        takes, every row's routing counted (the C++ block counts them all; a decode graph's padding rows must not)."""
        w = self.ffn_weights
        return (
            w is not None
            and block_rows(x)
            and x.dtype in DTYPES
            and getattr(self.experts, "count_rows", None) is None
            and (not isinstance(w, PackedFfnWeights) or x.dtype is w.dtype)  # the dtype chose its products
        )

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """``x + ffn(norm(x))``, counting a MoE's routing into ``routing_counts``."""
        w = self.ffn_weights
        if isinstance(w, PackedFfnWeights):
            return cpu_few_rows.packed_ffn_block(x, self.routing_counts, w)
        return cpu_few_rows.ffn_block(x, self.routing_counts, w, self.backend.moe_scratch)


def fuse_decoder_layer(layer, backend) -> FusedDecoderLayer | None:
    """The fused halves of a loaded DeepSeek-V3 ``DecoderLayer`` (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``), or None when neither half can be fused."""
    attention = attention_weights(layer.input_layernorm, layer.self_attn)
    ffn = ffn_weights(layer.post_attention_layernorm, layer.mlp)
    if ffn is None:  # packed routed experts: the C++ block where it takes the layer
        ffn = packed_ffn_weights(layer.post_attention_layernorm, layer.mlp)
    packed = None if ffn is not None else PackedFfnBlock.build(layer.post_attention_layernorm, layer.mlp, backend)
    if attention is None and ffn is None and packed is None:
        return None
    experts = getattr(layer.mlp, "experts", None)
    counts = experts.routing_counts if experts is not None else torch.empty(0, dtype=torch.int64)
    return FusedDecoderLayer(attention, ffn, counts, backend, experts, packed)


def run_fused_layers(fused: list[FusedDecoderLayer | None], x: torch.Tensor, meta, caches) -> torch.Tensor | None:
    """Every decoder layer of a decode step as its two C++ blocks in one loop, the hidden state after
    the last layer; None (nothing run) unless every layer has both halves fused and takes this step
    whole (decodes only, no padding rows, a row count and dtype the blocks take). The same calls with
    the same arguments as the layers make one by one; what goes is the Python between them (module
    calls, the per-layer checks, a padding-row check per layer): about 0.1 ms a layer here."""
    if not (fused and block_rows(x) and x.dtype in DTYPES and meta.decodes_only(x.shape[0])):
        return None
    for f in fused:
        if f is None or f.attention_weights is None or not f.ffn_fusable(x):
            return None
    if written_rows(meta.slot_mapping) is not None:
        return None
    attention, ffn_block, packed_block = (
        cpu_few_rows.attention_block,
        cpu_few_rows.ffn_block,
        cpu_few_rows.packed_ffn_block,
    )
    step = (meta.positions, meta.slot_mapping)
    tables = (meta.decode_block_tables, meta.decode_context_lens, meta.block_size)
    for f, cache in zip(fused, caches):
        x = attention(x, *step, cache.view(-1, cache.shape[-1]), *tables, f.attention_weights)
        w = f.ffn_weights
        if isinstance(w, PackedFfnWeights):
            x = packed_block(x, f.routing_counts, w)
        else:
            x = ffn_block(x, f.routing_counts, w, f.backend.moe_scratch)
    return x
