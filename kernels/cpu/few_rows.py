"""Few-row products on the CPU (``cpu_few_rows.cpp``, ``cpu_mla_decode.cpp``), built on first use.

Decode multiplies 1-16 rows of activations by each weight. There the cost is reading the weight,
but MKL's time grows with the row count (2 rows cost 1.2-1.5x one row, 4 rows about 2x), and the
MoE layer pays a dispatch per expert on top. The C++ loops read each weight tile once for all rows,
and ``moe`` runs a whole MoE layer's routed experts in one call. ``mla_decode`` reads the latent
cache in place through the block tables instead of gathering every sequence's context first, and
``mla_decode_absorbed`` runs all of a decode-only MLA layer between its projections (norm, rope,
cache write, W_UK, attention, W_UV) in one call; ``rms_norm`` is one call instead of eight ATen
operations. ``attention_block`` and ``ffn_block`` (``cpu_decode_block.cpp``) chain those kernels
into each half of a decoder layer for a few decode rows, so the Python between them goes too.

The arithmetic is float32. Weights (and the MLA latent cache) may be float32 or bf16: bf16 ones are
widened in registers by an exact 16-bit shift and run the float32 loops unchanged, so a bf16 model
reads half the bytes per decode step and a row's result is the float32 kernel's on the widened
weights. bf16 activations are widened on entry and the result rounded back to bf16. From 6 rows
on, a bf16 linear (and a MoE expert with 6+ pairs) runs oneDNN's bf16 product instead (AMX where
the CPU has it), faster there than the 8-wide float32 FMAs; those rows' bits then depend on the row
count, as every BLAS product's do. Where the CPU (and OS) give AMX-BF16 tiles, a bf16 MoE expert of
1-512 pairs runs ``cpu_moe_amx.cpp`` instead: the expert's weight is the tiles' A operand as it lies
(oneDNN lays it out again on every call, and experts are too large to keep a packed copy), the
pairs' activations are rounded to bf16 and re-laid out into the B operand, float32 sums; a token's
bits there do not depend on the other tokens of its expert.

The extension is compiled when the package is installed, for x86-64-v3 (AVX2 + FMA) and for plain
x86-64, and the variant this CPU runs is imported (``kernels/cpu/build.py``; a checkout whose C++ changed
since compiles it just in time, announced and locked). Without a compiler ``available()`` is False and the CPU backend (``kernels.cpu_backend``, the only caller,
which also honours ``KIMITUI_CPU_KERNELS=0`` through its settings) keeps its PyTorch paths.
``python -m kernels.cpu_few_rows`` builds it ahead of time.
"""

import functools
import logging

import torch

from kimitui.kernels.cpu.build import FEW_ROWS, load_extension

log = logging.getLogger(__name__)

MAX_ROWS = 16  # linear(): up to this many rows (1.2-1.3x BLAS at 16, even at 24, slower at 32+; 2 cores)
# moe() and moe_route(): up to this many tokens. moe against BLAS per expert: 1.13-1.85x at 128-2048
# tokens (experts with 32+ pairs run BLAS single-threaded, one expert per thread); not measured above.
MAX_MOE_TOKENS = 4096
# mla_decode() and mla_decode_absorbed(): up to this many sequences (mla_decode 3.9x at 1, 1.8x at 4,
# 1.3x at 16; the fused layer 2.1 ms less per single-request step, even at 8-16 sequences)
MAX_MLA_SEQS = 16
# The decode blocks (attention_block, ffn_block) of a bf16 model on a CPU where oneDNN has a native
# bf16 product: up to this many rows. Their products run oneDNN on packed weights from 6 rows on and
# the MLA between them is batched over the step's sequences (W_UK / W_UV read once a step), so a wide
# step gains the blocks' one call per half over the op-by-op layers (whose bf16 MLA decode is the
# PyTorch reference's gather). A float32 model keeps MAX_ROWS: its block products are the widening
# loops, slower than BLAS past 24 rows.
MAX_BF16_BLOCK_ROWS = 64
# The CPU backend's bf16 products of MAX_ROWS + 1 up to this many rows run linear_amx() where it can
# (the LM head of a wide decode step: the blocks take the layers). benchmarks/cpu_moe_amx.py, LM head
# 32000 x 1024 against F.linear (oneDNN lays the weight out again per call), 2-core AMX Xeon,
# contended, medians of 21 alternating pairs: 1.47x at 17 rows, 1.01x at 32, 1.17x at 64, 0.84x at 96,
# 0.81x at 128 (the tiles re-read the packed rows for every 32 weight rows; oneDNN's re-layout is
# then paid back).
MAX_AMX_LINEAR_ROWS = 64
# ... and only for weights of at least this many elements (32 MB of bf16): the LM heads. A prefill's
# projections at 64 rows (0.6-17 MB each) ran 1.05-2.6x slower on the tiles than on oneDNN (2026-12-06,
# the same Xeon, idle: K3's prompt of 64 tokens took longer than llama.cpp's with them on the tiles); a
# 42 MB and a 419 MB weight ran 1.2-1.7x faster on the tiles at 17 and 64 rows.
MIN_AMX_LINEAR_ELEMENTS = 16 << 20


@functools.cache
def _module():
    return load_extension(FEW_ROWS, log, "CPU few-row kernels")


def available() -> bool:
    """True when the extension is built (building it on the first call)."""
    return _module() is not None


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w [N, K].T -> [..., N]``; float32 or bf16 CPU tensors (the result in x's dtype),
    ``w`` contiguous."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, w has {k}")
    if x.dim() == 2 and x.is_contiguous():  # the usual decode call: no reshapes
        return _module().linear(x, w)
    out = _module().linear(x.reshape(-1, k).contiguous(), w)
    return out.view(*x.shape[:-1], n)


@functools.cache
def amx_usable() -> bool:
    """Whether the AMX-BF16 products (``linear_amx``, the MoE's bf16 experts) run here: the extension
    is built, the CPU has AMX-BF16 and the OS lets this process use the tiles (asked once)."""
    return available() and bool(_module().moe_amx_usable())


def linear_amx(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w [N, K].T`` for a contiguous bf16 ``w`` on AMX-BF16 tiles (``cpu_moe_amx.cpp``),
    the weight read as it lies (no re-layout, no packed copy), x rounded to bf16, float32 sums; the
    result in x's dtype. Only where ``amx_usable()``."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, w has {k}")
    out = _module().linear_amx(x.reshape(-1, k).contiguous(), w)
    return out.view(*x.shape[:-1], n)


def moe(
    x,
    topk_ids,
    topk_weights,
    w13,
    w2,
    scratch: torch.Tensor | None = None,
    act: str = "silu",
    beta: float = 1.0,
    linear_beta: float | None = None,
) -> torch.Tensor:
    """Gated MoE over dense float32 or bf16 experts, as ``reference.moe_experts_reference``: x [T, D],
    topk [T, k], w13 [E, 2I, D], w2 [E, D, I] -> [T, D]. ``scratch``: a float32 CPU tensor the
    caller owns and lends to one call at a time; the kernel grows it (up to 64 MB) to keep the
    per-pair expert outputs between calls (None: a buffer for this call only). ``act`` "silu" or
    "situ" with ``beta`` / ``linear_beta`` (None: up unbounded), as ``kernels.activation``."""
    if act not in ("silu", "situ") or (linear_beta is not None and linear_beta <= 0):
        raise ValueError(
            f"cpu_few_rows.moe: activation {act!r} (linear_beta={linear_beta}) is not silu or situ with positive betas"
        )
    scratch = torch.empty(0) if scratch is None else scratch
    return _module().moe(
        x.contiguous(),
        topk_ids.long().contiguous(),
        topk_weights.float().contiguous(),
        w13,
        w2,
        scratch,
        int(act == "situ"),
        float(beta),
        0.0 if linear_beta is None else float(linear_beta),
    )


def moe_route(x, weight, bias, top_k, n_group, topk_group, scoring_func, norm_topk_prob, scaling):
    """The MoE router, as ``reference.moe_route``: float32 x [T, D], weight [E, D], bias [E] ->
    (topk_ids [T, k] int64, topk_weights [T, k] float32)."""
    return _module().moe_route(
        x.reshape(-1, x.shape[-1]).contiguous(),
        weight,
        bias,
        top_k,
        n_group,
        topk_group,
        scoring_func == "sigmoid",
        norm_topk_prob,
        float(scaling),
    )


def mla_decode(q, cache, block_tables, context_lens, block_size, kv_lora_rank, scale) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache, as ``reference.mla_decode_reference``:
    q [B, H, r + rope], cache [slots, r + rope], block_tables [B, max_blocks], context_lens [B] -> [B, H, r]."""
    return _module().mla_decode(
        q.contiguous(),
        cache,
        block_tables.int().contiguous(),
        context_lens.int().contiguous(),
        block_size,
        kv_lora_rank,
        float(scale),
    )


def mla_decode_absorbed(
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
) -> torch.Tensor:
    """One MLA layer's absorbed decode step after its projections, decodes only: q [B, H, nope + rope]
    (q_b_proj), kv [B, r + rope] (kv_a_proj_with_mqa, before its norm), the rotary cos/sin tables
    [P, rope / 2], positions and cache slots [B], W_UK [H, nope, r], W_UV [H, v, r], cache
    [slots, r + rope]. Writes each sequence's newest latent to its slot -> [B, H, v]."""
    return _module().mla_decode_absorbed(
        q.contiguous(),
        kv.contiguous(),
        kv_norm_weight,
        float(eps),
        cos,
        sin,
        positions.long().contiguous(),
        slots.long().contiguous(),
        w_uk,
        w_uv,
        cache,
        block_tables.int().contiguous(),
        context_lens.int().contiguous(),
        block_size,
        float(scale),
    )


def attention_block(x, positions, slots, cache, block_tables, context_lens, block_size, weights) -> torch.Tensor:
    """``x + o_proj(MLA(norm(x)))`` for x [B, D], decodes only (``mla_decode_absorbed``'s positions,
    slots, cache and tables; int64 positions and slots, int32 tables), writing each sequence's newest
    latent; ``weights``: a ``kernels.cpu.decode_block.AttentionBlockWeights`` (whose ``residual``,
    ``norm`` and ``gate`` also give Kimi Linear / K3's form: ``o_proj(sigmoid(gate x) * MLA(x))``)."""
    return _module().attention_block(
        x, positions, slots, cache, block_tables, context_lens, block_size, *weights.kernel_args
    )


def ffn_block(x, counts, weights, scratch: torch.Tensor) -> torch.Tensor:
    """``x + ffn(norm(x))`` for x [T, D]; a MoE counts each token's experts into ``counts`` [E] int64
    (an empty tensor for a dense MLP); ``weights``: a ``kernels.cpu_decode_block.FfnBlockWeights``;
    ``scratch`` as for ``moe``."""
    return _module().ffn_block(x, counts, *weights.kernel_args, scratch)


def packed_ffn_block(x, counts, weights) -> torch.Tensor:
    """``x + MoE(norm(x))`` for x [T, D] whose routed experts are packed tiles (INT4 / MXFP4), counting
    each token's experts into ``counts`` [E] int64; ``weights``: a ``kernels.cpu.packed_ffn_block.PackedFfnWeights``.
    Needs ``use_packed_experts`` (the packed-experts extension's kernels) first."""
    return _module().packed_ffn_block(x, counts, *weights.kernel_args)


def latent_moe_block(x, counts, weights) -> torch.Tensor:
    """Kimi Linear / K3's MoE of normed rows x [T, D] over packed routed experts (no residual), counting each
    token's experts into ``counts``; ``weights``: a ``kernels.cpu.packed_ffn_block.LatentMoeWeights``."""
    return _module().latent_moe_block(x, counts, *weights.kernel_args)


def kda_block(x, slots, conv_state, rec_state, weights) -> torch.Tensor:
    """A KDA layer's decode step for normed rows x [N, D], one token of each of N sequences in state
    slots [N] (int64, real and distinct), updating their conv and recurrent states; ``weights``: a
    ``kernels.cpu.k3_blocks.KdaBlockWeights``. Needs ``use_kda_decode`` first. -> [N, D], no residual."""
    return _module().kda_block(x, slots, conv_state, rec_state, *weights.kernel_args)


def use_kda_decode(capsule) -> None:
    """Link the K3 decode extension's ``kda_decode`` (its ``kda_capsule()``) in, for ``kda_block``."""
    _module().use_kda_decode(capsule)


def use_packed_experts(capsules) -> None:
    """Link the packed-experts extension's MoE kernels (its ``experts_capsules()``) in, for ``packed_ffn_block``."""
    _module().use_packed_experts(*capsules)


def rms_norm(x, weight, eps) -> torch.Tensor:
    """HF RMSNorm over the last dim of float32 ``x [..., D]``."""
    d = weight.shape[0]
    if x.shape[-1] != d:
        raise ValueError(f"x has {x.shape[-1]} features, the norm weight {d}")
    return _module().rms_norm(x.reshape(-1, d).contiguous(), weight, float(eps)).view(x.shape)


def threads() -> int:
    """The thread count the extension's parallel loops use (torch's, set by ``torch.set_num_threads``)."""
    return _module().threads()


def team_capsule():
    """This extension's thread team (``kernels/cpu/csrc/cpu_team.h``), for another extension's ``use_team``."""
    return _module().team_capsule()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("CPU few-row kernels:", "built" if available() else "unavailable")
