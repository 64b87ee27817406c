"""Routed experts (SwiGLU, or SiTU: ``activation``) on a CPU in PyTorch (the CPU backend's path when
the C++ MoE does not apply).

``moe_grouped`` groups (token, slot) pairs by expert and runs each active expert once on all its
tokens, so a quantised expert is dequantised once per call, and only if it received tokens. INT4
experts held by the CPU with bf16 activations go through torch's CPU int4 GEMM instead (prepacked
once at load). The per-token oracle these are tested against is ``kernels.reference``.
"""

import torch
import torch.nn.functional as F

from kimitui.kernels.cpu.linear import linear_cpu
from kimitui.kernels.reference import dequant_fp8_block, dequant_int4, dequant_mxfp4, int4_nibbles


def _swiglu(x, up_proj, down_proj, activation=None):
    # x [c, D]; up_proj(x) -> [c, 2I] (gate columns, then up); down_proj(h [c, I]) -> [c, D];
    # activation: a kernels.activation.GatedActivation (None: SiLU)
    gate_up = up_proj(x)
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return down_proj(F.silu(gate) * up if activation is None else activation(gate, up))


def _swiglu_expert(x, w13, w2, activation=None):
    # x [c, D], w13 [2I, D] (gate rows, then up), w2 [D, I] -> [c, D]
    return _swiglu(x, lambda h: linear_cpu(h, w13), lambda h: linear_cpu(h, w2), activation)


def _dense_experts(expert_weights, activation=None):
    # expert_weights(e) -> (w13 [2I, D], w2 [D, I]) as matrices: the expert callable moe_grouped runs
    return lambda e, rows: _swiglu_expert(rows, *expert_weights(e), activation)


# Below this many bytes of gathered rows (T*k rows of D) one gather of every (token, slot) pair runs
# fewer operations than per-expert gathers (decode); above it, fresh multi-MB buffers cost as much
# in page faults as the expert products do (prefill), so each expert gathers its own rows.
_MOE_GATHER_ALL_BYTES = 8 << 20


def moe_grouped(x, topk_ids, topk_weights, num_experts, expert):
    # Group (token, slot) pairs by expert and run each active expert once on its tokens.
    # expert(e, rows [c, D]) -> [c, D], so quantised variants touch (dequantise) only the experts
    # that received tokens. An id equal to num_experts marks a pair computed
    # elsewhere (another rank, host RAM): it adds nothing.
    # Every path adds a token's weighted expert outputs in fp32, one at a time, in ascending expert
    # order, so the paths agree with each other whatever the batch (the products themselves may
    # round differently with the number of rows BLAS sees).
    t, top_k = topk_ids.shape
    topk_ids, slot_order = topk_ids.sort(dim=1)
    topk_weights = topk_weights.float().gather(1, slot_order)
    d = x.shape[-1]
    if t == 1:
        # One token (single-request decode): its k experts in ascending order, nothing to group.
        out = torch.zeros(1, d, dtype=torch.float32, device=x.device)
        for i, e in enumerate(topk_ids[0].tolist()):  # host sync: reference only
            if e < num_experts:
                out += expert(e, x).float() * topk_weights[0, i]
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs sorted by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()[:num_experts]  # host sync: reference only
    tokens = order // top_k
    if t * top_k * d * x.element_size() <= _MOE_GATHER_ALL_BYTES:
        xs = x.index_select(0, tokens)  # [T*k, D], rows grouped by expert
        y = torch.zeros(t * top_k, d, dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if count:
                y[start : start + count] = expert(e, xs[start : start + count])
            start += count
        # Back to (token, slot) order by a gather (a scatter is slow on CPUs), then the slots in
        # order; rows of pairs computed elsewhere stay zero.
        y = y.index_select(0, torch.argsort(order)).view(t, top_k, d) * topk_weights[..., None]
        out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
        for j in range(top_k):
            out += y[:, j]
        return out.to(x.dtype)
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = tokens[start : start + count]
            y = expert(e, x.index_select(0, rows)).float()  # [c, D]
            out.index_add_(0, rows, y.mul_(weights[start : start + count, None]))
        start += count
    return out.to(x.dtype)


def moe_experts(x, topk_ids, topk_weights, w13, w2, activation=None):
    """Gated MoE over dense stacked experts: x [T, D], w13 [E, 2I, D] (gate rows, then up), w2 [E, D, I].
    ``activation`` (here and below): a ``kernels.activation.GatedActivation``, None for SiLU."""
    return moe_grouped(
        x,
        topk_ids,
        topk_weights,
        w13.shape[0],
        _dense_experts(lambda e: (w13[e].to(x.dtype), w2[e].to(x.dtype)), activation),
    )


def moe_experts_w4a16(
    x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, activation=None
):
    """INT4 experts: w13_packed [E, 2I, ceil(D/8)], w13_scale [E, 2I, ceil(D/g)]; w2 likewise."""
    d, i = x.shape[-1], w13_packed.shape[1] // 2  # w13 holds 2I rows

    def weights(e):
        return (
            dequant_int4(w13_packed[e], w13_scale[e], d, group_size, x.dtype),
            dequant_int4(w2_packed[e], w2_scale[e], i, group_size, x.dtype),
        )

    return moe_grouped(x, topk_ids, topk_weights, w13_packed.shape[0], _dense_experts(weights, activation))


def moe_experts_mxfp4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation=None):
    """MXFP4 experts: w13_packed [E, 2I, D/2], w13_scale [E, 2I, D/32]; w2 likewise."""

    def weights(e):
        return dequant_mxfp4(w13_packed[e], w13_scale[e], x.dtype), dequant_mxfp4(w2_packed[e], w2_scale[e], x.dtype)

    return moe_grouped(x, topk_ids, topk_weights, w13_packed.shape[0], _dense_experts(weights, activation))


def moe_experts_fp8(x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128), activation=None):
    """Block-FP8 experts: w13 [E, 2I, D] + scale_inv [E, 2I/bn, D/bk], w2 [E, D, I] + scale_inv."""

    def weights(e):
        return (
            dequant_fp8_block(w13[e], w13_scale_inv[e], block, x.dtype),
            dequant_fp8_block(w2[e], w2_scale_inv[e], block, x.dtype),
        )

    return moe_grouped(x, topk_ids, topk_weights, w13.shape[0], _dense_experts(weights, activation))


# ---------------------------------------------------------------------------------------------
# INT4 experts on a CPU through torch's int4 GEMM (``_weight_int4pack_mm_for_cpu``, the tinygemm
# CPU kernel). Its weight layout depends on the CPU's vector width, so torch converts it once
# (``_convert_weight_to_int4pack_for_cpu``); its formula ``(q - 8) * scale + zero`` with zero = 0 is
# exactly the compressed-tensors one. With bf16 activations it is 8-14x faster per MoE step than
# dequantising each expert per call (benchmarks/cpu_experts.py); its fp32 kernel is a scalar loop.


def int4pack_cpu_supported(n: int, k: int, group_size: int) -> bool:
    """Whether torch's CPU int4 GEMM takes an [n, k] weight in groups of ``group_size``."""
    ops = torch.ops.aten
    return (
        hasattr(ops, "_weight_int4pack_mm_for_cpu")
        and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
        and n % 16 == 0
        and k % group_size == 0
        and group_size in (32, 64, 128, 256)
    )


def prepack_int4_cpu(packed, scale, k, group_size, dtype):
    """compressed-tensors INT4 (packed int32 [N, K/8], scale [N, K/g]) -> (torch's CPU int4 layout
    uint8 [N, K/2], scales_and_zeros [K/g, N, 2] in ``dtype``, the activations' dtype)."""
    codes = int4_nibbles(packed, k).to(torch.int32)  # 0..15
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.zeros(k // group_size, packed.shape[0], 2, dtype=dtype)
    scales_zeros[..., 0] = scale.t().to(dtype)
    return weight, scales_zeros


def prepack_int4_stack(packed, scale, k, group_size, dtype):
    """``prepack_int4_cpu`` for each expert of packed [E, N, K/8], scale [E, N, K/g], into one
    preallocated stack (one expert's temporaries at a time) -> (weight [E, ...], scales_zeros
    [E, K/g, N, 2])."""
    stack = None
    for i in range(packed.shape[0]):
        weight, scales_zeros = prepack_int4_cpu(packed[i], scale[i], k, group_size, dtype)
        if stack is None:
            stack = (
                weight.new_empty(packed.shape[0], *weight.shape),
                scales_zeros.new_empty(packed.shape[0], *scales_zeros.shape),
            )
        stack[0][i], stack[1][i] = weight, scales_zeros
    return stack


def linear_int4pack_cpu(x, weight, scales_zeros, group_size):
    """``x [..., K] @ W.T`` for a weight from ``prepack_int4_cpu`` (computed in scales_zeros.dtype)."""
    rows = x.reshape(-1, x.shape[-1]).to(scales_zeros.dtype).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, group_size, scales_zeros)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def moe_experts_int4pack_cpu(x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size, activation=None):
    """MoE with INT4 experts prepacked for the CPU: w13 [E, 2I, D/2] + w13_sz [E, D/g, 2I, 2],
    w2 [E, D, I/2] + w2_sz [E, I/g, D, 2] (``prepack_int4_cpu`` per expert)."""

    def expert(e, rows):
        return _swiglu(
            rows,
            lambda h: linear_int4pack_cpu(h, w13[e], w13_sz[e], group_size),
            lambda h: linear_int4pack_cpu(h, w2[e], w2_sz[e], group_size),
            activation,
        )

    return moe_grouped(x, topk_ids, topk_weights, w13.shape[0], expert)
