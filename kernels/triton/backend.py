"""The device backend: Triton kernels for CUDA/ROCm tensors (or CPU tensors under TRITON_INTERPRET=1).

Quantised GEMMs, the fused MoE and the paged MLA decode run as Triton kernels; a dense linear is
``F.linear`` (cuBLAS/hipBLASLt beat a hand-written GEMM there). The small ops around them are one
launch each instead of op by op (a decode step is launch-bound): RMSNorm, the residual add + norm
(with the router's fp32 copy), the gated activation of a dense MLP, the router after its gate GEMM
(with the routing statistics), MLA's cache write (norm + rope + scatter of the newest latents, with
the query LoRA's norm), its absorbed decode query (W_UK product + rope) and the fused MoE's top-k
combine. Each kernel is tested against its oracle (``kernels.reference`` or this module's base
class, ``Backend``). Kimi K3's decode has its own: a whole KDA decode step (``kernels.kda_decode``),
each AttnRes mix with its norm (``kernels.attn_res_mix``), MLA's NoPE cache write and absorbed query,
its sigmoid output gate. Kimi Delta Attention's prefill (and speculative verification) runs
fla-core's Triton kernels on CUDA/ROCm tensors when fla imports (a model with KDA layers on a GPU
without it is refused by ``attach_backends``), else the PyTorch forms of ``kernels.kda``. Only
``kernels.select`` imports this module, once triton is known to work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimitui.kernels.backend import Backend
from kimitui.kernels.triton import (
    attn_res_mix,
    fused_add_rms_norm,
    fused_moe,
    gated_act,
    kda_decode,
    kda_fla,
    mla_cache_write,
    mla_decode,
    mla_q_absorb,
    moe_router,
    rms_norm,
    rope_fused,
    sigmoid_gate,
)
from kimitui.kernels.triton.gemm import fp8_block, mxfp4, w4a16


def _fla(x) -> bool:
    return x.device.type == "cuda" and kda_fla.available()


def _as_rows(x):
    # [..., K] -> [M, K] without copying when possible.
    return x.reshape(-1, x.shape[-1])


class TritonBackend(Backend):
    name = "triton"

    def linear_fp8_block(self, x, w, scale_inv, block=(128, 128)):
        out = fp8_block.fp8_block_gemm(_as_rows(x), w, scale_inv, tuple(block))
        return out.view(*x.shape[:-1], w.shape[0])

    def linear_w4a16(self, x, packed, scale, k, group_size=32):
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} input features, the INT4 weight has {k}")
        out = w4a16.w4a16_gemm(_as_rows(x), packed, scale, group_size)
        return out.view(*x.shape[:-1], packed.shape[0])

    def linear_mxfp4(self, x, packed, scale):
        out = mxfp4.mxfp4_gemm(_as_rows(x), packed, scale)
        return out.view(*x.shape[:-1], packed.shape[0])

    def gated_act(self, gu, act):
        # SiLU or SiTU and the multiply in one launch (op by op: two, or about eight for SiTU)
        return gated_act.gated_act(gu, act.kind, act.beta, act.linear_beta)

    def rms_norm(self, x, weight, eps=1e-6):
        return rms_norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps=1e-6):
        # the sum goes into x (the caller's fresh tensor): each program reads its row before writing it
        return fused_add_rms_norm.fused_add_rms_norm(x, residual, weight, eps, residual_out=x)

    def add_rms_norm_fp32(self, x, residual, weight, eps=1e-6):
        if torch.promote_types(weight.dtype, x.dtype) == torch.float32:  # the output is the fp32 copy
            out, s = self.add_rms_norm(x, residual, weight, eps)
            return out, s, out
        out32 = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        out, s = fused_add_rms_norm.fused_add_rms_norm(x, residual, weight, eps, residual_out=x, out32=out32)
        return out, s, out32

    def moe_route(
        self,
        x,
        weight,
        bias,
        top_k,
        n_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        scaling=1.0,
        counts=None,
        weights_dtype=None,
        count_rows=None,
    ):
        # The gate GEMM in fp32 as the reference computes it (routing is sensitive to rounding), then
        # sigmoid, bias, group limit, top-k, renormalisation, the weights' rounding (to the dtype the
        # experts take them in) and the routing statistics in one launch: 2 launches when x comes in fp32
        # (the norm's fp32 copy), else 3 with the cast; no host sync (the op-by-op group mask needs
        # repeat_interleave, which sizes its output on the host).
        logits = F.linear(x.float(), weight.float())  # [T, E]
        return moe_router.moe_route_logits(
            logits,
            bias,
            top_k,
            n_group,
            topk_group,
            scoring_func,
            norm_topk_prob,
            scaling,
            counts=counts,
            weights_dtype=weights_dtype or torch.float32,
            count_rows=count_rows,
        )

    def mla_rope_query(self, q_pe, rope, positions, out=None):
        # The kernel rotates q heads and one key row together; the key is written by mla_cache_write,
        # so it gets query head 0 and a scratch output here (one launch either way). ``out`` (the tail
        # of the absorbed query buffer) is written through its strides.
        t, _, r = q_pe.shape
        scratch = torch.empty((t, r), dtype=q_pe.dtype, device=q_pe.device)
        q, _ = rope_fused.rope_mla(q_pe, q_pe[:, 0], rope.cos, rope.sin, positions, q_out=out, k_out=scratch)
        return q

    def mla_absorb_query(self, q, w_uk, rope, positions):
        # the W_UK product and the query rope (NoPE: the copy of q_pe) in one launch, written straight
        # into the absorbed query
        cos, sin = (None, None) if rope is None else (rope.cos, rope.sin)
        return mla_q_absorb.mla_q_absorb(q, w_uk.to(q.dtype), cos, sin, positions)

    def mla_cache_write(self, kv, norm_weight, eps, rope, positions, slot_mapping, cache):
        # NoPE (Kimi Linear / K3, rope None): the key is written unrotated, same launch
        cos, sin = (None, None) if rope is None else (rope.cos, rope.sin)
        mla_cache_write.mla_cache_write(kv, norm_weight, eps, cos, sin, positions, slot_mapping, cache)

    def mla_cache_write_q_norm(
        self, q, q_norm_weight, q_eps, kv, norm_weight, eps, rope, positions, slot_mapping, cache
    ):
        # both norms of the layer input's projection and the key rope (or NoPE copy) in one launch
        cos, sin = (None, None) if rope is None else (rope.cos, rope.sin)
        return mla_cache_write.mla_cache_write(
            kv, norm_weight, eps, cos, sin, positions, slot_mapping, cache, q, q_norm_weight, q_eps
        )

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, activation=None):
        return fused_moe.fused_moe(x, topk_ids, topk_weights, w13, w2, activation=activation)

    def moe_experts_w4a16(
        self, x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, activation=None
    ):
        return fused_moe.fused_moe_w4a16(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, activation=activation
        )

    def moe_experts_mxfp4(self, x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation=None):
        return fused_moe.fused_moe_mxfp4(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation=activation
        )

    def moe_experts_fp8(
        self, x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128), activation=None
    ):
        return fused_moe.fused_moe_fp8(
            x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, tuple(block), activation=activation
        )

    def mla_decode(self, q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale):
        return mla_decode.mla_decode(
            q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale
        )

    def kda_chunk(self, q, k, v, g, beta, initial_state, cu_seqlens, scale):
        if _fla(q):
            return kda_fla.chunk_kda(q, k, v, g, beta, initial_state, cu_seqlens, scale)
        return super().kda_chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale)

    def kda_recurrent(self, q, k, v, g, beta, state, slots, scale):
        if _fla(q):
            return kda_fla.recurrent_kda(q, k, v, g, beta, state, slots, scale)
        return super().kda_recurrent(q, k, v, g, beta, state, slots, scale)

    def kda_recurrent_spec(self, q, k, v, g, beta, state, indices, lengths, scale):
        if _fla(q):
            return kda_fla.recurrent_kda_spec(q, k, v, g, beta, state, indices, lengths, scale)
        return super().kda_recurrent_spec(q, k, v, g, beta, state, indices, lengths, scale)

    def causal_conv1d(self, x, weight, history, cu_seqlens=None):
        if _fla(x):
            return kda_fla.causal_conv1d(x, weight, history, cu_seqlens)
        return super().causal_conv1d(x, weight, history, cu_seqlens)

    def kda_decode(
        self,
        qkv,
        f_b,
        b,
        gate,
        conv_weight,
        A_log,
        dt_bias,
        lower_bound,
        norm_weight,
        eps,
        conv_state,
        rec_state,
        slots,
        scale,
    ):
        # conv, gate, beta, l2 norms, the delta-rule step on the slots' state and the gated output norm
        # in one launch (op by op: 56 on the PyTorch path; fla-core's conv and recurrent kernels and the ops
        # around them on a GPU)
        return kda_decode.kda_decode(
            qkv,
            f_b,
            b,
            gate,
            conv_weight,
            A_log,
            dt_bias,
            lower_bound,
            norm_weight,
            eps,
            conv_state,
            rec_state,
            slots,
            scale,
        )

    def attn_res_mix_norm(
        self, x, blocks, n, res_norm_weight, res_eps, proj_weight, norm_weight, norm_eps, delta=None, save=False
    ):
        # the residual add, the snapshot, the softmax mix over the blocks and the norm after it in one
        # launch (op by op: about eighteen)
        return attn_res_mix.attn_res_mix_norm(
            x, blocks, n, res_norm_weight, res_eps, proj_weight, norm_weight, norm_eps, delta, save
        )

    def sigmoid_gate(self, x, gate):
        return sigmoid_gate.sigmoid_gate(x, gate)  # one launch (op by op: two)
