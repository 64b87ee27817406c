"""The kernel entry points the engine calls: Triton on CUDA/ROCm tensors, PyTorch elsewhere.

A call uses Triton when its tensors live on a ``cuda`` device (ROCm reports ``cuda`` too) and
triton imports; otherwise the PyTorch reference in ``kernels.reference`` runs on whatever device
the tensors are on, except the few-row float32 decode shapes on a CPU, which go to the C++ loops
of ``kernels.cpu_few_rows`` when that extension builds. ``KIMITUI_KERNELS=reference`` forces the
reference everywhere (debugging, numerics comparisons). Kernel modules are imported lazily so this
module never needs triton.
"""

import functools
import importlib
import importlib.util
import os

import torch

from kernels import cpu_few_rows, reference


@functools.cache
def triton_available() -> bool:
    """True when the triton package can be imported (checked once)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("triton.language")
    except Exception:  # a broken install (e.g. no compiler backend) counts as missing
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether calls on ``tensor``'s device go to the Triton kernels."""
    return tensor.device.type == "cuda" and not _forced_reference() and triton_available()


def _forced_reference() -> bool:
    return os.environ.get("KIMITUI_KERNELS", "").lower() == "reference"


def use_cpu_few_rows(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether a float32 CPU call on ``x`` and ``weights`` goes to ``kernels.cpu_few_rows`` (callers
    also check their row limit)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    for w in weights:  # a plain loop: this runs for every decode linear, where microseconds add up
        if w.dtype != torch.float32 or not w.is_contiguous():
            return False
    return not _forced_reference() and cpu_few_rows.available()


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"kernels.{module}"), name)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    # [..., K] -> [M, K] without copying when possible.
    return x.reshape(-1, x.shape[-1])


def linear(x, w):
    """``x [..., K] @ w [N, K].T -> [..., N]`` for a dense weight (``F.linear``; CPU BLAS gets the
    few-row decode shapes through ``cpu_few_rows``, or else in a form it streams faster, see
    ``reference.linear_cpu``)."""
    if 0 < x.numel() // max(x.shape[-1], 1) <= cpu_few_rows.MAX_ROWS and use_cpu_few_rows(x, w):
        return cpu_few_rows.linear(x, w)
    return reference.linear(x, w)


def linear_fp8_block(x, w, scale_inv, block=(128, 128)):
    """``x [..., K] @ dequant(w [N, K] fp8 e4m3fn, scale_inv).T -> [..., N]`` in x.dtype."""
    if not use_triton(x):
        return reference.linear_fp8_block(x, w, scale_inv, block)
    out = _kernel("fp8_block_gemm", "fp8_block_gemm")(_as_rows(x), w, scale_inv, tuple(block))
    return out.view(*x.shape[:-1], w.shape[0])


def linear_w4a16(x, packed, scale, k, group_size=32):
    """``x [..., K] @ dequant_int4(packed [N, ceil(K/8)], scale [N, ceil(K/g)]).T -> [..., N]``."""
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the INT4 weight has {k}")
    if not use_triton(x):
        return reference.linear_w4a16(x, packed, scale, k, group_size)
    out = _kernel("w4a16_gemm", "w4a16_gemm")(_as_rows(x), packed, scale, group_size)
    return out.view(*x.shape[:-1], packed.shape[0])


def linear_mxfp4(x, packed, scale):
    """``x [..., K] @ dequant_mxfp4(packed [N, K/2], scale [N, K/32]).T -> [..., N]``."""
    if not use_triton(x):
        return reference.linear_mxfp4(x, packed, scale)
    out = _kernel("mxfp4_gemm", "mxfp4_gemm")(_as_rows(x), packed, scale)
    return out.view(*x.shape[:-1], packed.shape[0])


def mla_decode(q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale):
    """Absorbed MLA decode over the paged latent cache: q [B, H, r + rope], cache [slots, r + rope],
    block_tables [B, max_blocks] int32, context_lens [B] int32 -> [B, H, r] in q.dtype."""
    if 0 < q.shape[0] <= cpu_few_rows.MAX_MLA_SEQS and use_cpu_few_rows(q, cache):
        return cpu_few_rows.mla_decode(q, cache, block_tables, context_lens, block_size, kv_lora_rank, scale)
    if not use_triton(q):
        return reference.mla_decode_reference(q, cache, block_tables, context_lens, max_context_len, block_size,
                                              kv_lora_rank, scale)
    return _kernel("mla_decode", "mla_decode")(q, cache, block_tables, context_lens, max_context_len, block_size,
                                               kv_lora_rank, scale)


def mla_decode_fusable(x, cache, w_uk, w_uv) -> bool:
    """Whether a decode-only MLA step on ``x [B, D]`` runs as one ``mla_decode_absorbed`` call (the
    C++ CPU kernel, float32, up to ``MAX_MLA_SEQS`` sequences); else the layer runs op by op."""
    return 0 < x.shape[0] <= cpu_few_rows.MAX_MLA_SEQS and use_cpu_few_rows(x, cache, w_uk, w_uv)


def mla_decode_absorbed(q, kv, kv_norm_weight, eps, cos, sin, positions, slots, w_uk, w_uv, cache, block_tables,
                        context_lens, block_size, scale):
    """Norm, rope and cache write of the newest latents, W_UK absorption, attention over the paged
    cache and W_UV, for decodes only, where ``mla_decode_fusable`` holds -> [B, H, v]."""
    return cpu_few_rows.mla_decode_absorbed(q, kv, kv_norm_weight, eps, cos, sin, positions, slots, w_uk, w_uv, cache,
                                            block_tables, context_lens, block_size, scale)


def decode_block_weights_ok(*weights: torch.Tensor) -> bool:
    """Whether a decoder layer's residual blocks can run as one C++ call each (``attention_block``,
    ``ffn_block``): its weights are contiguous float32 CPU tensors and the extension is built. Checked
    once, after loading; ``decode_block_fusable`` checks each step's rows."""
    return all(w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() for w in weights) \
        and cpu_few_rows.available()


def decode_block_fusable(x: torch.Tensor) -> bool:
    """Whether this step's ``x [T, D]`` goes through the fused blocks: up to ``MAX_ROWS`` float32 CPU rows."""
    return (0 < x.shape[0] <= cpu_few_rows.MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and not _forced_reference())


def attention_block(x, positions, slots, cache, block_tables, context_lens, block_size, weights):
    """``x + o_proj(MLA(norm(x)))`` for decodes only (see ``cpu_few_rows.attention_block``)."""
    return cpu_few_rows.attention_block(x, positions, slots, cache, block_tables, context_lens, block_size, weights)


def ffn_block(x, counts, weights):
    """``x + MoE or MLP(norm(x))`` (see ``cpu_few_rows.ffn_block``)."""
    return cpu_few_rows.ffn_block(x, counts, weights)


def rms_norm(x, weight, eps=1e-6):
    """HF RMSNorm over the last dim of ``x [..., H]``."""
    if use_cpu_few_rows(x, weight):
        return cpu_few_rows.rms_norm(x, weight, eps)
    if not use_triton(x):
        return reference.rms_norm(x, weight, eps)
    return _kernel("rms_norm", "rms_norm")(x, weight, eps)


def moe_route(x, weight, bias, top_k, n_group=1, topk_group=1, scoring_func="sigmoid", norm_topk_prob=True,
              scaling=1.0):
    """DeepSeek-V3 router: x [T, D], weight [E, D], bias [E] -> (topk_ids [T, k] int64, topk_weights
    [T, k] fp32). The C++ loop for few float32 rows on a CPU, else the PyTorch reference."""
    if 0 < x.shape[0] <= cpu_few_rows.MAX_MOE_TOKENS and use_cpu_few_rows(x, weight, bias):
        return cpu_few_rows.moe_route(x, weight, bias, top_k, n_group, topk_group, scoring_func, norm_topk_prob,
                                      scaling)
    return reference.moe_route(x, weight, bias, top_k, n_group, topk_group, scoring_func, norm_topk_prob, scaling)


def moe_experts(x, topk_ids, topk_weights, w13, w2):
    """SwiGLU MoE, dense experts: x [T, D], topk [T, k], w13 [E, 2I, D], w2 [E, D, I] -> [T, D]."""
    if 0 < x.shape[0] <= cpu_few_rows.MAX_MOE_TOKENS and use_cpu_few_rows(x, w13, w2):
        return cpu_few_rows.moe(x, topk_ids, topk_weights, w13, w2)
    if not use_triton(x):
        return reference.moe_experts_reference(x, topk_ids, topk_weights, w13, w2)
    return _kernel("fused_moe", "fused_moe")(x, topk_ids, topk_weights, w13, w2)


def moe_experts_w4a16(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32):
    """SwiGLU MoE, INT4 experts (w13_packed [E, 2I, D/8], scales [E, 2I, D/g]; w2 likewise)."""
    if not use_triton(x):
        return reference.moe_experts_reference_w4a16(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size
        )
    return _kernel("fused_moe", "fused_moe_w4a16")(
        x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size
    )


def moe_experts_int4pack_cpu(x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size):
    """SwiGLU MoE, INT4 experts in torch's CPU int4 layout (``reference.prepack_int4_cpu``)."""
    return reference.moe_experts_int4pack_cpu(x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size)


def moe_experts_mxfp4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale):
    """SwiGLU MoE, MXFP4 experts (w13_packed [E, 2I, D/2], w13_scale [E, 2I, D/32]; w2 likewise)."""
    if not use_triton(x):
        return reference.moe_experts_reference_mxfp4(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale
        )
    return _kernel("fused_moe", "fused_moe_mxfp4")(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)


def moe_experts_fp8(x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128)):
    """SwiGLU MoE, block-FP8 experts (w13 [E, 2I, D] e4m3fn + scale_inv [E, 2I/bn, D/bk]; w2 likewise)."""
    if not use_triton(x):
        return reference.moe_experts_reference_fp8(x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv,
                                                   block)
    return _kernel("fused_moe", "fused_moe_fp8")(x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv,
                                                  tuple(block))


# ---------------------------------------------------------------------------------------------
# Kimi Delta Attention: fla-core's Triton kernels on CUDA/ROCm tensors when it imports, else the
# PyTorch forms of kernels.kda. Shapes and meaning are those of kernels/kda.py.


def _use_fla(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and not _forced_reference() and _kernel("kda_fla", "available")()


def kda_chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale):
    """Prefill of packed sequences from their states: (o [T, H, V], final_state [N, H, K, V] fp32)."""
    if _use_fla(q):
        return _kernel("kda_fla", "chunk_kda")(q, k, v, g, beta, initial_state, cu_seqlens, scale)
    return _kernel("kda", "chunk_kda")(q, k, v, g, beta, initial_state, cu_seqlens, scale)


def kda_recurrent(q, k, v, g, beta, state, slots, scale):
    """One decode token per sequence; ``state[slots]`` is updated in place. -> o [N, H, V]"""
    if _use_fla(q):
        return _kernel("kda_fla", "recurrent_kda")(q, k, v, g, beta, state, slots, scale)
    return _kernel("kda", "recurrent_kda")(q, k, v, g, beta, state, slots, scale)


def causal_conv1d(x, weight, history, cu_seqlens=None):
    """Short causal conv + SiLU continuing each sequence's history: (y [T, C], new history [N, C, W-1])."""
    if _use_fla(x):
        return _kernel("kda_fla", "causal_conv1d")(x, weight, history, cu_seqlens)
    return _kernel("kda", "causal_conv1d")(x, weight, history, cu_seqlens)


# ---------------------------------------------------------------------------------------------
# Packed INT4 / MXFP4 experts held by the CPU: kernels.cpu_quant_moe reads them in place.


def cpu_quant_moe_ready(fmt, hidden, inter, group_size=32) -> bool:
    """Whether ``moe_experts_cpu_quant`` runs the C++ kernels (``kernels.cpu_quant_moe``) for CPU-held
    ``fmt`` experts of this shape, rather than the dequantising reference."""
    from kernels import cpu_quant_moe

    return (not _forced_reference() and cpu_quant_moe.supports(fmt, hidden, inter, group_size)
            and cpu_quant_moe.available())


def moe_experts_cpu_quant(x, topk_ids, topk_weights, fmt, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32):
    """SwiGLU MoE over packed ``fmt`` ("int4" or "mxfp4") experts held by the CPU, x float32 or bf16:
    the packed weights are read in place by ``kernels.cpu_quant_moe``; the reference where it does not
    apply. Shapes as ``moe_experts_w4a16`` / ``moe_experts_mxfp4``."""
    from kernels import cpu_quant_moe

    if cpu_quant_moe_ready(fmt, x.shape[-1], w13_packed.shape[1] // 2, group_size):
        return cpu_quant_moe.moe(x, topk_ids, topk_weights, fmt, w13_packed, w13_scale, w2_packed, w2_scale,
                                 group_size)
    if fmt == "int4":
        return reference.moe_experts_reference_w4a16(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed,
                                                     w2_scale, group_size)
    return reference.moe_experts_reference_mxfp4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
