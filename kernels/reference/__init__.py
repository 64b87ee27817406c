"""PyTorch references for every kernel in this package: the oracle, and only that.

These are the ground truth the Triton kernels, the C++ CPU kernels and the CPU backend's PyTorch
paths (``kernels.cpu_linear``, ``kernels.cpu_moe``) are tested against, written for clarity rather
than speed; the reference backend (``KIMITUI_KERNELS=reference``) runs them. Everything stays on the
input's device.

Quantised formats:
- FP8 block (K2, DeepSeek-V3; DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``):
  ``W = fp8 * scale_inv[i // bn, j // bk]``, fp32 scales.
- INT4 compressed-tensors "pack-quantized" (K2-Thinking, K2.5, K2.6; neuralmagic/compressed-tensors
  ``compressors/quantized_compressors/pack_quantized.py``): int32 words of 8 nibbles,
  lowest nibble = lowest column, offset-8 encoded; ``W = q * scale[i, j // group_size]``.
- MXFP4 (K3; OCP Microscaling Formats (MX) v1.0 spec): uint8 bytes of 2 E2M1 codes, low nibble =
  even column, E8M0 scale per 32 columns.
"""

import functools
import sys

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
MXFP4_BLOCK = 32
# E2M1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between the positive E2M1 magnitudes, for round-to-nearest in quantize_mxfp4.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expand_blocks(scale: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    # [..., ceil(N/bn), ceil(K/bk)] -> [..., N, K]
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


# ---------------------------------------------------------------------------------------------
# FP8 block-wise


def dequant_fp8_block(w, scale_inv, block=(128, 128), dtype=torch.float32):
    """Dequantise block-FP8 weights ``w [..., N, K]`` with ``scale_inv [..., ceil(N/bn), ceil(K/bk)]``."""
    bn, bk = block
    n, k = w.shape[-2:]
    s = _expand_blocks(scale_inv.float(), bn, bk, n, k)
    return (w.float() * s).to(dtype)


def quantize_fp8_block(w, block=(128, 128)):
    """Quantise ``w [N, K]`` to (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]).

    One scale per block, ``amax / 448``; partial edge blocks are zero-padded for the amax.
    """
    bn, bk = block
    n, k = w.shape
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))  # [nb, kb]
    # An all-zero block would give scale 0 and 0/0 below; any positive scale encodes zeros exactly.
    scale_inv = (amax / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w.float() / _expand_blocks(scale_inv, bn, bk, n, k)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


# ---------------------------------------------------------------------------------------------
# INT4 compressed-tensors pack-quantized


def int4_nibbles(packed, k):
    """The stored nibbles u = q + 8 (0..15) of int32 words ``[..., ceil(K/8)]`` as uint8 ``[..., K]``.

    Column j sits in word j // 8 at bits 4*(j % 8). Words are raw bits: negative int32 values are
    fine.
    """
    if sys.byteorder == "little":
        # Byte i of a row holds column 2i in its low nibble and 2i+1 in its high one: two byte ops
        # instead of eight shifts of every word (4-5x faster on a K2-sized expert).
        b = packed.to(torch.int32).contiguous().view(torch.uint8)
        return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)[..., :k]
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)  # [8]
    u = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [..., W, 8]; & drops the sign bits
    return u.flatten(-2)[..., :k].to(torch.uint8)


def unpack_int4(packed, k):
    """Unpack int32 words ``[..., ceil(K/8)]`` to int8 ``[..., K]`` in [-8, 7] (stored offset-8:
    u = q + 8; see int4_nibbles for the layout)."""
    return int4_nibbles(packed, k).to(torch.int8) - 8


def pack_int4(q):
    """Pack int8 ``q [..., K]`` in [-8, 7] into int32 words ``[..., ceil(K/8)]`` (inverse of unpack_int4).

    Columns past K are filled with q = 0 (u = 8), so a kernel reading the padding sees zeros.
    """
    k = q.shape[-1]
    u = q.to(torch.int64) + 8
    u = F.pad(u, (0, _cdiv(k, 8) * 8 - k), value=8)
    u = u.unflatten(-1, (-1, 8))  # [..., W, 8]
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (u << shifts).sum(dim=-1)  # [..., W], 0 .. 2^32 - 1
    # Reinterpret as signed int32 (two's complement) without relying on overflow behaviour.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def quantize_int4(w, group_size=32):
    """Symmetric group-wise INT4, compressed-tensors convention: ``scale = amax / 7.5``.

    compressed-tensors' minmax observer divides by ``(qmax - qmin) / 2 = 15 / 2``; q is then
    ``clamp(round(w / scale), -8, 7)``. Returns (packed int32 [N, ceil(K/8)],
    scale [N, ceil(K/g)] in w.dtype for floating w, else bf16). Partial groups are zero-padded.
    """
    n, k = w.shape
    scale_dtype = w.dtype if w.dtype.is_floating_point else torch.bfloat16
    groups = _cdiv(k, group_size)
    padded = F.pad(w.float(), (0, groups * group_size - k))
    amax = padded.view(n, groups, group_size).abs().amax(dim=-1)  # [N, G]
    scale = (amax / 7.5).clamp(min=torch.finfo(torch.float32).eps).to(scale_dtype)
    # Quantise against the stored (possibly bf16) scale so dequant reproduces the same grid.
    s = scale.float().repeat_interleave(group_size, dim=-1)[:, :k]
    q = torch.round(w.float() / s).clamp(-8, 7).to(torch.int8)
    return pack_int4(q), scale


@functools.lru_cache(maxsize=8)
def _int4_byte_table(device: torch.device) -> torch.Tensor:
    # byte -> (low nibble - 8, high nibble - 8): one lookup decodes two columns  [256, 2]
    b = torch.arange(256, dtype=torch.int32)
    return torch.stack([(b & 15) - 8, (b >> 4) - 8], dim=-1).float().to(device)


def dequant_int4(packed, scale, k, group_size=32, dtype=torch.float32):
    """Dequantise INT4 words ``[..., N, ceil(K/8)]`` with ``scale [..., N, ceil(K/g)]`` to ``[..., N, K]``."""
    if packed.shape[-1] * 8 == k and k % group_size == 0 and group_size % 2 == 0 and sys.byteorder == "little":
        # Fast path: read the words as bytes (little-endian: column 2i in the low nibble of byte i)
        # and decode through a 256-entry table, then apply the group scales by broadcasting.
        lead = packed.shape[:-1]
        by = packed.contiguous().view(torch.uint8).reshape(-1, k // 2).to(torch.int32)
        w = F.embedding(by, _int4_byte_table(packed.device)).view(*lead, k // group_size, group_size)
        return (w * scale.float().unsqueeze(-1)).reshape(*lead, k).to(dtype)
    q = unpack_int4(packed, k).float()
    s = scale.float().repeat_interleave(group_size, dim=-1)[..., :k]
    return (q * s).to(dtype)


# ---------------------------------------------------------------------------------------------
# MXFP4 (OCP MX, E2M1 values, E8M0 scale per 32 columns)


def _e8m0_to_float(scale):
    # 2^(s - 127); byte 255 is NaN in E8M0.
    f = torch.exp2(scale.float() - 127.0)
    return torch.where(scale == 255, torch.full_like(f, float("nan")), f)


def dequant_mxfp4(packed, scale, dtype=torch.float32):
    """Dequantise MXFP4 ``packed uint8 [..., N, K/2]`` with ``scale uint8 [..., N, K/32]`` to ``[..., N, K]``."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # [..., N, K], low = even
    values = lut[codes.long()]
    s = _e8m0_to_float(scale).repeat_interleave(MXFP4_BLOCK, dim=-1)
    return (values * s).to(dtype)


def quantize_mxfp4(w):
    """Quantise ``w [N, K]`` (K a multiple of 32) to (packed uint8 [N, K/2], scale uint8 [N, K/32]).

    The block exponent is rounded up (``ceil(log2(amax / 6))``) so no element clips, as
    triton_kernels' default; the OCP spec's ``floor(log2(amax)) - 2`` would clip the largest values.
    Elements round to the nearest E2M1 value.
    """
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs K to be a multiple of {MXFP4_BLOCK}, got K={k}")
    blocks = w.float().view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # [N, K/32]
    exp = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(neginf=-127.0)
    exp = exp.clamp(-127, 127)  # byte 0 .. 254
    scaled = blocks / torch.exp2(exp).unsqueeze(-1)
    mids = torch.tensor(_E2M1_MIDPOINTS, device=w.device)
    mag = torch.bucketize(scaled.abs().clamp(max=6.0).contiguous(), mids)  # index 0..7
    codes = (mag | ((scaled < 0).to(mag.dtype) << 3)).view(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Linear layers: x [..., K] -> [..., N], in x.dtype (matmul accumulates in fp32)


def linear(x, w):
    """``x [..., K] @ w [N, K].T -> [..., N]`` for a dense weight."""
    return F.linear(x, w)


def linear_fp8_block(x, w, scale_inv, block=(128, 128)):
    """``x @ dequant_fp8_block(w).T`` in x.dtype."""
    return linear(x, dequant_fp8_block(w, scale_inv, block, dtype=x.dtype))


def linear_w4a16(x, packed, scale, k, group_size=32):
    """``x @ dequant_int4(w).T`` in x.dtype."""
    return linear(x, dequant_int4(packed, scale, k, group_size, dtype=x.dtype))


def linear_mxfp4(x, packed, scale):
    """``x @ dequant_mxfp4(w).T`` in x.dtype."""
    return linear(x, dequant_mxfp4(packed, scale, dtype=x.dtype))


def rms_norm(x, weight, eps=1e-6):
    """HF RMSNorm: normalise in fp32, cast to x.dtype, then multiply by weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# MoE router (DeepSeek-V3 noaux_tc): group-limited top-k; the correction bias steers selection only


def _router_scores(logits, scoring_func):
    # NaN-safe router scores: a NaN logit counts as -inf (sigmoid 0); a NaN score (softmax of a row
    # of -inf) as 0. Every router (this, kernels/triton/moe_router.py, the C++ CPU one) does the same, so a
    # NaN hidden state routes to valid experts with weight 0 instead of an expert id past E.
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)
    return scores.masked_fill(scores.isnan(), 0.0)


def _router_choice(scores, bias):
    choice = scores if bias is None else scores + bias.float()
    return choice.masked_fill(choice.isnan(), float("-inf"))


def moe_route(
    x, weight, bias, top_k, n_group=1, topk_group=1, scoring_func="sigmoid", norm_topk_prob=True, scaling=1.0
):
    """x [T, D], weight [E, D], bias [E] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32); ids in
    descending order of score + bias. Computed in fp32 whatever x's dtype. NaN-safe (``_router_scores``)."""
    logits = F.linear(x.float(), weight.float())  # [T, E]
    scores = _router_scores(logits, scoring_func)
    choice = _router_choice(scores, bias)
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, weights * scaling


# ---------------------------------------------------------------------------------------------
# MoE experts (SwiGLU): y_t = sum_k w_tk * w2[e] @ (silu(gate_e x_t) * (up_e x_t)); every function
# takes ``activation`` (a kernels.activation.GatedActivation, None: SiLU) in place of silu(g) * u.


def _moe(x, topk_ids, topk_weights, num_experts, expert_weights, activation=None):
    # y_t = sum over t's slots, in ascending expert order, of w_tk * w2[e] @ (silu(g) * u), [g; u] =
    # w13[e] @ x_t, summed in fp32. expert_weights(e) -> (w13 [2I, D], w2 [D, I]) in x.dtype. An id
    # equal to num_experts marks a pair computed elsewhere (another rank, host RAM): it adds nothing.
    ids, slot_order = topk_ids.sort(dim=1)
    weights = topk_weights.float().gather(1, slot_order)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():  # ascending; host sync: reference only
        if e >= num_experts:
            continue
        tokens, slots = (ids == e).nonzero(as_tuple=True)  # each token holds an expert at most once
        w13, w2 = expert_weights(e)
        gate_up = F.linear(x.index_select(0, tokens), w13)  # [c, 2I]
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        h = F.silu(gate) * up if activation is None else activation(gate, up)
        y = F.linear(h, w2).float()  # [c, D]
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out.to(x.dtype)


def moe_experts_reference(x, topk_ids, topk_weights, w13, w2, activation=None):
    """SwiGLU MoE over dense stacked experts: x [T, D], w13 [E, 2I, D] (gate rows, then up), w2 [E, D, I]."""
    return _moe(x, topk_ids, topk_weights, w13.shape[0], lambda e: (w13[e].to(x.dtype), w2[e].to(x.dtype)), activation)


def moe_experts_reference_w4a16(
    x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, activation=None
):
    """MoE with INT4 experts.

    w13_packed [E, 2I, ceil(D/8)], w13_scale [E, 2I, ceil(D/g)], w2_packed [E, D, ceil(I/8)],
    w2_scale [E, D, ceil(I/g)].
    """
    d, i = x.shape[-1], w13_packed.shape[1] // 2  # w13 holds 2I rows

    def weights(e):
        return (
            dequant_int4(w13_packed[e], w13_scale[e], d, group_size, x.dtype),
            dequant_int4(w2_packed[e], w2_scale[e], i, group_size, x.dtype),
        )

    return _moe(x, topk_ids, topk_weights, w13_packed.shape[0], weights, activation)


def moe_experts_reference_mxfp4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation=None):
    """MoE with MXFP4 experts.

    w13_packed [E, 2I, D/2], w13_scale [E, 2I, D/32], w2_packed [E, D, I/2], w2_scale [E, D, I/32].
    """

    def weights(e):
        return (
            dequant_mxfp4(w13_packed[e], w13_scale[e], x.dtype),
            dequant_mxfp4(w2_packed[e], w2_scale[e], x.dtype),
        )

    return _moe(x, topk_ids, topk_weights, w13_packed.shape[0], weights, activation)


def moe_experts_reference_fp8(
    x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128), activation=None
):
    """MoE with block-FP8 experts: w13 [E, 2I, D] + scale_inv [E, 2I/bn, D/bk], w2 [E, D, I] + scale_inv."""

    def weights(e):
        return (
            dequant_fp8_block(w13[e], w13_scale_inv[e], block, x.dtype),
            dequant_fp8_block(w2[e], w2_scale_inv[e], block, x.dtype),
        )

    return _moe(x, topk_ids, topk_weights, w13.shape[0], weights, activation)


# ---------------------------------------------------------------------------------------------
# MLA decode over a paged latent cache (absorbed form: DeepSeek-V2 paper, arXiv:2405.04434, section 2.1)


def mla_decode_reference(q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale):
    """One query per sequence against its cached latents, read through its block table.

    q [B, H, r + rope] (the query with W_UK folded in, then its rope part); cache [slots, r + rope]
    (latent, then roped shared key); block_tables [B, max_blocks] int32; context_lens [B] int32
    (each including the new token); ``max_context_len`` = max(context_lens), known to the host.
    Returns the attention-weighted latents [B, H, r] in q.dtype (W_UV is applied by the caller).
    """
    pos = torch.arange(max_context_len, device=q.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [B, L]
    # index_select copies whole rows: several times faster than advanced indexing on CPU
    lat = cache.index_select(0, slots.view(-1)).view(*slots.shape, -1).to(q.dtype)  # [B, L, r+rope]
    scores = torch.bmm(q, lat.transpose(1, 2)).float() * scale  # [B, H, L]: latent and rope parts at once
    padding = (pos[None, :] >= context_lens[:, None])[:, None, :]  # [B, 1, L] past each context
    p = scores.masked_fill(padding, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.bmm(p, lat[..., :kv_lora_rank])  # [B, H, r]


# ---------------------------------------------------------------------------------------------
# Fused small ops of the decode step (one Triton launch each on a GPU): fused_add_rms_norm
# (kernels/triton/fused_add_rms_norm.py), rope_mla (kernels/triton/rope_fused.py), mla_cache_write
# (kernels/triton/mla_cache_write.py), moe_route_logits (kernels/triton/moe_router.py), moe_align_block_size
# (kernels/triton/moe_align.py).


def fused_add_rms_norm(x, residual, weight, eps=1e-6):
    """(HF RMSNorm of x + residual, x + residual): the sum rounds to x.dtype before the norm."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def _rope_rows(x, cos, sin, positions):
    # x [T, n, R]: pair i of row t turns by (cos, sin)[positions[t], i], in fp32, cast back to x.dtype
    t, n, r = x.shape
    xf = x.float().reshape(t, n, r // 2, 2)
    c = cos[positions].view(t, 1, r // 2)
    s = sin[positions].view(t, 1, r // 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).reshape(t, n, r).to(x.dtype)


def rope_mla(q_pe, k_pe, cos, sin, positions):
    """Interleaved-pair rope of q_pe [T, H, R] and k_pe [T, R] (or [T, 1, R]) in fp32, cast back.

    cos/sin [P, R/2] fp32; pair i of a row at position p turns by (cos[p, i], sin[p, i]).
    """
    k3 = k_pe.reshape(k_pe.shape[0], 1, k_pe.shape[-1])
    return _rope_rows(q_pe, cos, sin, positions), _rope_rows(k3, cos, sin, positions).reshape(k_pe.shape)


def mla_cache_write(kv, norm_weight, eps, cos, sin, positions, slot_mapping, cache):
    """MLA's cache write as engine/layers/mla.py does it: cache[slot] = [rms_norm(kv[:, :r]), rope(kv[:, r:])].

    Rows whose slot lies outside the cache (-1 for padding) are skipped. Writes ``cache`` in place.
    """
    r = norm_weight.shape[0]
    c_kv = rms_norm(kv[:, :r], norm_weight, eps)
    k_pe = _rope_rows(kv[:, None, r:], cos, sin, positions)[:, 0]
    flat = cache.view(-1, cache.shape[-1])
    keep = (slot_mapping >= 0) & (slot_mapping < flat.shape[0])
    flat.index_copy_(0, slot_mapping[keep].long(), torch.cat([c_kv, k_pe], dim=-1)[keep].to(cache.dtype))


def _first_topk(v, k):
    # top-k of v [T, N] along the last dim, ties to the lower index (a stable descending sort)
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :k]


def moe_route_logits(
    logits, bias, top_k, n_group=1, topk_group=1, scoring_func="sigmoid", norm_topk_prob=True, scaling=1.0
):
    """``moe_route`` after the gate GEMM: logits [T, E] -> (ids [T, k] int64, weights fp32).

    Ties (equal biased scores, equal group scores) pick the lower id, as the kernel does. NaN-safe
    (``_router_scores``): a NaN row picks the lowest-choice ties' lowest ids, weight 0.
    """
    scores = _router_scores(logits.float(), scoring_func)
    choice = _router_choice(scores, bias)
    t, e = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        best2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
        group_scores = best2.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, _first_topk(group_scores, topk_group), True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = _first_topk(choice, top_k)  # [T, k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def moe_align_block_size(topk_ids, block_size, num_experts):
    """Pairs sorted by expert (stable), each expert padded to ``block_size`` slots, as a plain loop.

    Same outputs and sizes as ``kernels.moe_align.moe_align_block_size``; ids outside
    [0, num_experts) get no slot. For tests: O(T*k) Python steps.
    """
    flat = topk_ids.reshape(-1).tolist()
    numel = len(flat)
    num_blocks = min(-(-(numel + num_experts * (block_size - 1)) // block_size), numel)
    sorted_ids = [numel] * (num_blocks * block_size)
    expert_ids = [num_experts - 1] * num_blocks  # see the end
    slot = 0
    for e in range(num_experts):
        pairs = [i for i, x in enumerate(flat) if x == e]
        if not pairs:
            continue
        sorted_ids[slot : slot + len(pairs)] = pairs
        tiles = -(-len(pairs) // block_size)
        expert_ids[slot // block_size : slot // block_size + tiles] = [e] * tiles
        slot += tiles * block_size
    # tiles past the last used one keep E - 1 (the PyTorch version's clamp); the GEMM skips them
    as_int32 = dict(dtype=torch.int32, device=topk_ids.device)
    return torch.tensor(sorted_ids, **as_int32), torch.tensor(expert_ids, **as_int32), torch.tensor([slot], **as_int32)


# Kimi K3's oracles live in their own module; re-exported so ``reference.<name>`` names every oracle.
from kimitui.kernels.reference.k3 import attn_res_mix, causal_conv1d_reference, kda_recurrence_reference  # noqa: E402,F401
