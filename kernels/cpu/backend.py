"""The CPU backend: the C++ few-row kernels where they apply, BLAS-shaped PyTorch everywhere else.

Decode multiplies a few rows of activations by each weight; there the C++ loops of
``kernels.cpu_few_rows`` (float32 arithmetic on float32 or bf16 weights, built once per machine) beat
BLAS, and a whole decoder half runs as one call (``kernels.cpu_decode_block``). Prefill-sized calls,
fp16, or a machine where the extension does not build take ``kernels.cpu_linear`` and
``kernels.cpu_moe``. Whether the extension is used is decided once, when the backend is made; each
call then only checks its own shape (rows, dtype), which a fixed choice cannot know ahead.

The backend owns the C++ MoE's scratch buffers (the per-pair expert outputs, kept between calls so a
prefill does not page-fault a fresh one in every layer): one per calling thread, since the C++ kernels
run without the GIL and host-RAM experts run on threads of their own (one per NUMA node), side by side.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

from kimitui.kernels import reference
from kimitui.kernels.backend import Backend, count_routing, written_rows
from kimitui.kernels.cpu import (
    few_rows as cpu_few_rows,
)
from kimitui.kernels.cpu import k3_blocks
from kimitui.kernels.cpu import (
    k3_decode as cpu_k3_decode,
)
from kimitui.kernels.cpu import (
    linear as cpu_linear,
)
from kimitui.kernels.cpu import (
    moe as cpu_moe,
)
from kimitui.kernels.cpu import (
    quant_moe as cpu_quant_moe,
)
from kimitui.kernels.cpu.decode_block import fuse_decoder_layer, run_fused_layers
from kimitui.kernels.cpu.packed_ffn_block import latent_moe_weights
from kimitui.kernels.settings import KernelSettings

_F32 = torch.float32
_BF16 = torch.bfloat16
CXX_DTYPES = (_F32, _BF16)  # model dtypes the C++ kernels serve
# bf16 linears below this many rows stay in the C++ widening loops on a CPU without oneDNN's native
# bf16 product (AVX2 only): widening the weight to float32 per call costs more there (a 5632 x 1024
# weight at 64 rows, 2 threads on an AVX2 EPYC: 9.0 ms in the loops against 21 ms widened; even at 128)
_BF16_LOOP_ROWS = 128


def _f32(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    # float32 activations and float32 contiguous weights. A plain loop: this runs for every decode
    # linear, where microseconds add up.
    if x.dtype != _F32:
        return False
    for w in weights:
        if w.dtype != _F32 or not w.is_contiguous():
            return False
    return True


def _cxx_dtypes(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    # float32 or bf16 activations, contiguous weights of one dtype, float32 or bf16: what the C++
    # linear and MoE take (they compute in float32 and round the result to x's dtype)
    if x.dtype is not _F32 and x.dtype is not _BF16:
        return False
    wd = weights[0].dtype
    if wd is not _F32 and wd is not _BF16:
        return False
    for w in weights:
        if w.dtype is not wd or not w.is_contiguous():
            return False
    return True


def _act_kwargs(activation) -> dict:
    # the gated activation as the C++ MoE kernels' wrappers take it; None: SiLU
    if activation is None:
        return {}
    return dict(act=activation.kind, beta=activation.beta, linear_beta=activation.linear_beta)


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, settings: KernelSettings = KernelSettings(), dtype: torch.dtype = _F32):
        # The C++ kernels compute in float32 on float32 or bf16 weights: an fp16 model never builds them.
        self.settings = settings
        self.cxx = settings.cpu_kernels and dtype in CXX_DTYPES and cpu_few_rows.available()
        self._scratch = threading.local()

    @property
    def moe_scratch(self) -> torch.Tensor:
        """The calling thread's scratch for the C++ MoE, grown in place by it up to its cap (64 MB)."""
        scratch = getattr(self._scratch, "tensor", None)
        if scratch is None:
            # Never an inference tensor, even when the backend is used under torch.inference_mode:
            # calls outside it could not resize one.
            with torch.inference_mode(False):
                scratch = self._scratch.tensor = torch.empty(0, dtype=_F32)
        return scratch

    def __repr__(self) -> str:
        return f"CpuBackend(cxx={self.cxx})"

    # -- linear layers

    def linear(self, x, w):
        rows = x.numel() // max(x.shape[-1], 1)
        if self.cxx and 0 < rows <= cpu_few_rows.MAX_ROWS and _cxx_dtypes(x, w):
            return cpu_few_rows.linear(x, w)
        if (
            self.cxx
            and 0 < rows < _BF16_LOOP_ROWS
            and w.dtype is _BF16
            and _cxx_dtypes(x, w)
            and not cpu_linear.onednn_bf16_native()
        ):
            return cpu_few_rows.linear(x, w)
        if (
            self.cxx
            and cpu_few_rows.MAX_ROWS < rows <= cpu_few_rows.MAX_AMX_LINEAR_ROWS
            and w.numel() >= cpu_few_rows.MIN_AMX_LINEAR_ELEMENTS
            and w.dtype is _BF16
            and _cxx_dtypes(x, w)
            and cpu_few_rows.amx_usable()
        ):  # the LM head of a wide decode step: oneDNN would lay its weight out again on every call
            return cpu_few_rows.linear_amx(x, w)
        return cpu_linear.linear_cpu(x, w)

    def linear_fp8_block(self, x, w, scale_inv, block=(128, 128)):
        return cpu_linear.linear_cpu(x, reference.dequant_fp8_block(w, scale_inv, block, dtype=x.dtype))

    def linear_w4a16(self, x, packed, scale, k, group_size=32):
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} input features, the INT4 weight has {k}")
        return cpu_linear.linear_cpu(x, reference.dequant_int4(packed, scale, k, group_size, dtype=x.dtype))

    def linear_mxfp4(self, x, packed, scale):
        return cpu_linear.linear_cpu(x, reference.dequant_mxfp4(packed, scale, dtype=x.dtype))

    def gated_act(self, gu, act):
        # K3's SiTU for a few rows (decode): one C++ call instead of about ten ATen operations
        if (
            act.kind == "situ"
            and 0 < gu.shape[0] <= cpu_few_rows.MAX_ROWS
            and self.k3_cxx
            and cpu_k3_decode.situ_fits(gu)
        ):
            return cpu_k3_decode.situ_and_mul(gu, act.beta, act.linear_beta)
        return super().gated_act(gu, act)

    # -- norms and routing

    def rms_norm(self, x, weight, eps=1e-6):
        if x.dtype == weight.dtype == _F32:
            if self.cxx and weight.is_contiguous():
                return cpu_few_rows.rms_norm(x, weight, eps)
            # F.rms_norm runs the reference's operations in one call, bit-identical in fp32 (where the
            # cast is a no-op): a third of the time of the separate ops on a CPU.
            return F.rms_norm(x, weight.shape, weight, eps)
        if x.dtype == weight.dtype == _BF16:
            # the reference's steps in three calls instead of seven: normalise in fp32 (F.rms_norm, the
            # same bits as its separate operations), round to bf16, multiply by the bf16 weight in place
            # (bf16 x bf16 rounds once, as ``weight * h`` does): bit-identical to reference.rms_norm
            return F.rms_norm(x.float(), weight.shape, None, eps).to(_BF16).mul_(weight)
        return reference.rms_norm(x, weight, eps)

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
        # the router computes in float32 whatever x's dtype: a bf16 x (K3's latent MoE) is widened
        # exactly here and takes the C++ router too, as the reference's x.float() does
        xf = x.float() if x.dtype is _BF16 else x
        if self.cxx and 0 < x.shape[0] <= cpu_few_rows.MAX_MOE_TOKENS and _f32(xf, weight, bias):
            ids, weights = cpu_few_rows.moe_route(
                xf, weight, bias, top_k, n_group, topk_group, scoring_func, norm_topk_prob, scaling
            )
        else:
            ids, weights = reference.moe_route(
                x, weight, bias, top_k, n_group, topk_group, scoring_func, norm_topk_prob, scaling
            )
        count_routing(counts, ids, count_rows)
        return ids, weights if weights_dtype is None else weights.to(weights_dtype)

    # -- routed experts

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, activation=None):
        if self.cxx and 0 < x.shape[0] <= cpu_few_rows.MAX_MOE_TOKENS and _cxx_dtypes(x, w13, w2):
            return cpu_few_rows.moe(x, topk_ids, topk_weights, w13, w2, self.moe_scratch, **_act_kwargs(activation))
        return cpu_moe.moe_experts(x, topk_ids, topk_weights, w13, w2, activation)

    def quant_experts_native(self, fmt, hidden, inter, group_size=32) -> bool:
        """Whether packed ``fmt`` ("int4" / "mxfp4") experts of this shape are computed by the C++ kernels
        of ``kernels.cpu_quant_moe`` (codes decoded in registers), rather than dequantised per call."""
        return self.quant_cxx and cpu_quant_moe.supports(fmt, hidden, inter, group_size)

    @functools.cached_property
    def quant_cxx(self) -> bool:
        # Built on first use (a model without packed experts never compiles it).
        return self.settings.cpu_kernels and cpu_quant_moe.available()

    @property
    def w4a8(self) -> str:
        """The packed experts' W4A8 setting (``KernelSettings.cpu_w4a8``, ``cpu_quant_moe.moe``'s ``w4a8``)."""
        return self.settings.cpu_w4a8

    def moe_experts_w4a16(
        self, x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, activation=None
    ):
        if self.quant_experts_native("int4", x.shape[-1], w13_packed.shape[1] // 2, group_size):
            return cpu_quant_moe.moe(
                x,
                topk_ids,
                topk_weights,
                "int4",
                w13_packed,
                w13_scale,
                w2_packed,
                w2_scale,
                group_size,
                w4a8=self.w4a8,
                **_act_kwargs(activation),
            )
        return cpu_moe.moe_experts_w4a16(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, activation
        )

    def moe_experts_mxfp4(self, x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation=None):
        if self.quant_experts_native("mxfp4", x.shape[-1], w13_packed.shape[1] // 2):
            return cpu_quant_moe.moe(
                x,
                topk_ids,
                topk_weights,
                "mxfp4",
                w13_packed,
                w13_scale,
                w2_packed,
                w2_scale,
                w4a8=self.w4a8,
                **_act_kwargs(activation),
            )
        return cpu_moe.moe_experts_mxfp4(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation
        )

    def moe_experts_fp8(
        self, x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128), activation=None
    ):
        return cpu_moe.moe_experts_fp8(
            x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block, activation
        )

    def prepack_int4_experts(self, w13_packed, w13_scale, w2_packed, w2_scale, group_size, dtype):
        # Only for bf16 activations: torch vectorises that kernel (about 10x faster than dequantising
        # per call, benchmarks/cpu_experts.py); its fp32 and fp16 kernels are scalar loops, slower at
        # batch 16 than the dequantising path kept for them.
        if dtype != torch.bfloat16 or w13_packed.device.type != "cpu":
            return None
        if self.quant_experts_native("int4", w2_packed.shape[1], w13_packed.shape[1] // 2, group_size):
            return None  # prepare_quant_experts' tiles (the same bytes) are faster
        (_, n13, w13_words), (_, d, w2_words) = w13_packed.shape, w2_packed.shape
        k13, k2 = w13_words * 8, w2_words * 8
        if (
            k13 != d
            or k2 != n13 // 2
            or not (
                cpu_moe.int4pack_cpu_supported(n13, k13, group_size)
                and cpu_moe.int4pack_cpu_supported(d, k2, group_size)
            )
        ):
            return None
        return (
            *cpu_moe.prepack_int4_stack(w13_packed, w13_scale, k13, group_size, dtype),
            *cpu_moe.prepack_int4_stack(w2_packed, w2_scale, k2, group_size, dtype),
        )

    def prepare_quant_experts(self, fmt, w13_packed, w13_scale, w2_packed, w2_scale, group_size):
        # Host experts stream best as kernels.cpu_quant_moe's tiles (the same bytes, reordered).
        if w13_packed.device.type != "cpu" or not self.quant_experts_native(
            fmt, w2_packed.shape[1], w13_packed.shape[1] // 2, group_size
        ):
            return None
        tiled = cpu_quant_moe.prepare(fmt, w13_packed, w13_scale, w2_packed, w2_scale, group_size)
        return tiled.w13, tiled.w2

    def moe_experts_tiled(self, x, topk_ids, topk_weights, fmt, w13_tiles, w2_tiles, inter, activation=None):
        experts = cpu_quant_moe.TiledExperts(fmt, x.shape[-1], inter, w13_tiles, w2_tiles)
        return cpu_quant_moe.moe(
            x, topk_ids, topk_weights, fmt, experts, None, None, None, w4a8=self.w4a8, **_act_kwargs(activation)
        )

    def moe_experts_int4pack_cpu(self, x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size, activation=None):
        return cpu_moe.moe_experts_int4pack_cpu(
            x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size, activation
        )

    # -- MLA decode

    def mla_decode(self, q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale):
        # bf16 queries and latent cache too (K3's gated NoPE MLA, which the fused layer does not take): the
        # kernel widens them and attends in float32, rounding the output once (the PyTorch path rounds
        # its bf16 scores and probabilities as well)
        if (
            self.cxx
            and 0 < q.shape[0] <= cpu_few_rows.MAX_MLA_SEQS
            and _cxx_dtypes(q, cache)
            and q.dtype is cache.dtype
        ):
            return cpu_few_rows.mla_decode(q, cache, block_tables, context_lens, block_size, kv_lora_rank, scale)
        widen = q.dtype is _BF16 and not cpu_linear.onednn_bf16_native()  # see bmm
        o = reference.mla_decode_reference(
            q.float() if widen else q,
            cache,
            block_tables,
            context_lens,
            max_context_len,
            block_size,
            kv_lora_rank,
            scale,
        )
        return o.to(_BF16) if widen else o

    def bmm(self, a, b, out=None):
        # Without oneDNN's native bf16 product (AVX2 only) a bf16 bmm is a slow fallback: half of a
        # 64-request bf16 decode step went to the MLA bmms on an AVX2 EPYC. Those products run in
        # float32 there, rounded once.
        if a.dtype is _BF16 and b.dtype is _BF16 and not cpu_linear.onednn_bf16_native():
            y = torch.bmm(a.float(), b.float())
            return y.to(_BF16) if out is None else out.copy_(y)
        return torch.bmm(a, b, out=out)

    def mla_decode_fusable(self, x, cache, w_uk, w_uv) -> bool:
        return self.cxx and 0 < x.shape[0] <= cpu_few_rows.MAX_MLA_SEQS and _f32(x, cache, w_uk, w_uv)

    def mla_decode_absorbed(
        self,
        q,
        kv,
        kv_norm_weight,
        eps,
        cos,
        sin,
        positions,
        slots,
        w_uk,
        w_uv,
        cache,
        block_tables,
        context_lens,
        block_size,
        scale,
    ):
        rows = written_rows(slots)
        if rows is not None:  # a decode graph's padding rows (slot -1): zeros, no cache slot written
            out = q.new_zeros(q.shape[0], w_uv.shape[0], w_uv.shape[1])
            if rows.numel():
                out[rows] = self.mla_decode_absorbed(
                    q[rows],
                    kv[rows],
                    kv_norm_weight,
                    eps,
                    cos,
                    sin,
                    positions[rows],
                    slots[rows],
                    w_uk,
                    w_uv,
                    cache,
                    block_tables[rows],
                    context_lens[rows],
                    block_size,
                    scale,
                )
            return out
        return cpu_few_rows.mla_decode_absorbed(
            q,
            kv,
            kv_norm_weight,
            eps,
            cos,
            sin,
            positions,
            slots,
            w_uk,
            w_uv,
            cache,
            block_tables,
            context_lens,
            block_size,
            scale,
        )

    # -- Kimi K3 / Kimi Linear decode (KDA, attention residuals): one C++ call each

    @functools.cached_property
    def k3_cxx(self) -> bool:
        # Built on first use (a model without KDA or attention residuals never compiles it).
        return self.cxx and cpu_k3_decode.available()

    def kda_chunk(self, q, k, v, g, beta, initial_state, cu_seqlens, scale):
        # token by token in C++ (one thread per sequence and head): 3x the chunked form's speed here
        if self.k3_cxx and cpu_k3_decode.kda_sequential_fits(q, k, v, g, beta):
            return cpu_k3_decode.kda_sequential(q, k, v, g, beta, initial_state, cu_seqlens, scale)
        return super().kda_chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale)

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
        args = (qkv, f_b, b, gate, conv_weight, A_log, dt_bias, lower_bound, norm_weight, eps)
        if (
            self.k3_cxx
            and cpu_k3_decode.kda_decode_fits(qkv, rec_state, conv_state, slots)
            and written_rows(slots) is None  # padding rows: the base class drops them, then calls this again
        ):
            return cpu_k3_decode.kda_decode(*args, conv_state, rec_state, slots, scale)
        return super().kda_decode(*args, conv_state, rec_state, slots, scale)

    def attn_res_mix_norm(
        self, x, blocks, n, res_norm_weight, res_eps, proj_weight, norm_weight, norm_eps, delta=None, save=False
    ):
        args = (x, blocks, n, res_norm_weight, res_eps, proj_weight, norm_weight, norm_eps)
        # a few rows (decode): the C++ loop is one thread; a prefill's thousands of rows stay in ATen
        if self.k3_cxx and x.shape[0] <= cpu_few_rows.MAX_ROWS and cpu_k3_decode.attn_res_mix_fits(x, blocks, delta):
            return cpu_k3_decode.attn_res_mix_norm(*args, delta=delta, save=save)
        return super().attn_res_mix_norm(*args, delta=delta, save=save)

    # -- whole decoder halves

    def fuse_decoder_layer(self, layer):
        if not self.cxx:
            return None

        return fuse_decoder_layer(layer, self)

    def fuse_latent_moe(self, moe):
        return latent_moe_weights(moe) if self.cxx else None

    def fuse_attention(self, attn):
        if not self.cxx:
            return None
        # a KDA layer has its per-head decay rates (A_log); an MLA layer has none
        return k3_blocks.kda_block(attn) if hasattr(attn, "A_log") else k3_blocks.mla_block(attn)

    def run_fused_layers(self, fused, x, meta, caches):
        return run_fused_layers(fused, x, meta, caches)
