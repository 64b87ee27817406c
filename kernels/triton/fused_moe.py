"""Fused MoE experts (SwiGLU), vLLM-style grouped GEMM over expert-sorted token rows.

Pipeline (vLLM's ``vllm/model_executor/layers/fused_moe/fused_moe.py``): ``moe_align.align_pairs`` sorts the T*k (token, slot) pairs by expert
and pads each expert's run to BLOCK_M rows, so every M-tile belongs to one expert. GEMM1 reads
gate and up rows of w13 in the same program and writes ``act(gate, up)`` [T*k, I] (SiLU's
``silu(gate) * up``, or Kimi K3's SiTU: ``activation``, see ``kernels.activation``); GEMM2 reads
those rows, multiplies by w2 and the routing weight, and writes fp32 [T*k, D]; a third launch sums
each token's k slots and casts to the activation dtype. One kernel serves every expert format,
decoding weight tiles in-kernel: dense (``fused_moe``), compressed-tensors INT4
(``fused_moe_w4a16``), OCP MXFP4 (``fused_moe_mxfp4``, Kimi K3.x) and block FP8 (``fused_moe_fp8``).
References: ``reference.moe_experts_reference*``.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.activation import GatedActivation, resolve
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device, interpreting
from kimitui.kernels.triton.gated_act import _tanh  # portable tanh (no libdevice), shared with the dense MLP's launch
from kimitui.kernels.triton.gemm.mxfp4 import MXFP4_BLOCK, _mxfp4_tile
from kimitui.kernels.triton.gemm.w4a16 import _int4_scales, _int4_tile
from kimitui.kernels.triton.moe_align import align_pairs

# Weight formats of the experts (constexpr WFMT of the kernel).
DENSE, INT4, MXFP4, FP8 = 0, 1, 2, 3


@triton.jit
def _load_b(
    b_ptr,
    s_ptr,
    expert,
    offs_n,
    mask_n,
    k0,
    K,
    stride_be,
    stride_bn,
    stride_bk,
    stride_se,
    stride_sn,
    stride_sk,
    WFMT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    QBLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Returns the [BK, BN] fp32 weight tile [k0, k0 + BK) of one expert. GROUP_SIZE is the K extent of
    # one scale (INT4 group, 32 for MXFP4, the FP8 block's K side); QBLOCK_N the FP8 block's N side.
    # Packed formats load each word / byte and each scale once per tile and unpack in registers.
    expert = expert.to(tl.int64)  # no-op for the caller's int64; keeps every offset below in int64
    offs_n = offs_n.to(tl.int64)
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn  # [1, BN]
    s_row = s_ptr + expert * stride_se + offs_n[None, :] * stride_sn  # [1, BN]
    if WFMT == 1:  # INT4: eight signed nibbles per int32 word along K, one scale per group
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(
            b_base + kw.to(tl.int64)[:, None] * stride_bk, mask=(kw < (K + 7) // 8)[:, None] & mask_n[None, :], other=0
        )  # [BK/8, BN]
        sc = _int4_scales(
            s_row, k0, (K + GROUP_SIZE - 1) // GROUP_SIZE, mask_n, stride_sk, GROUP_SIZE, BLOCK_K, BLOCK_N
        )
        b = _int4_tile(words, BLOCK_K, BLOCK_N).to(tl.float32) * sc
    elif WFMT == 2:  # MXFP4: two E2M1 codes per byte (even k low), one E8M0 exponent per 32
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(
            b_base + kb.to(tl.int64)[:, None] * stride_bk, mask=(kb < K // 2)[:, None] & mask_n[None, :], other=0
        ).to(tl.int32)  # [BK/2, BN]
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        e = tl.load(
            s_row + ks.to(tl.int64)[:, None] * stride_sk, mask=(ks < K // 32)[:, None] & mask_n[None, :], other=127
        ).to(tl.int32)  # [BK/32, BN]
        b = _mxfp4_tile(byte, e, BLOCK_K, BLOCK_N)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[:, None] & mask_n[None, :]
        w = tl.load(b_base + offs_k.to(tl.int64)[:, None] * stride_bk, mask=mask, other=0.0).to(tl.float32)
        if WFMT == 3:  # FP8 e4m3fn with an fp32 scale per QBLOCK_N x GROUP_SIZE block
            s = tl.load(
                s_ptr
                + expert * stride_se
                + (offs_n[None, :] // QBLOCK_N) * stride_sn
                + (offs_k // GROUP_SIZE).to(tl.int64)[:, None] * stride_sk,
                mask=mask,
                other=0.0,
            )
            b = w * s
        else:
            b = w
    return b


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    s_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_valid_tokens,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_cm,
    stride_cn,
    act_beta,
    act_linear_beta,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LINEAR_BETA: tl.constexpr,
    WFMT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    QBLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)  # [BM] (token, slot) index
    valid = pair < num_valid_tokens
    a_rows = pair // TOP_K  # GEMM1 reads x rows; GEMM2 (TOP_K=1) reads pair rows
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + offs_k.to(tl.int64)[None, :] * stride_ak,
            mask=valid[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BM, BK]
        b = _load_b(
            b_ptr,
            s_ptr,
            expert,
            offs_n,
            mask_n,
            k0,
            K,
            stride_be,
            stride_bn,
            stride_bk,
            stride_se,
            stride_sn,
            stride_sk,
            WFMT,
            GROUP_SIZE,
            QBLOCK_N,
            BLOCK_K,
            BLOCK_N,
        )
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
        if GATED:
            # Up rows sit N (= I) rows below the gate rows of w13 [E, 2I, K].
            b_up = _load_b(
                b_ptr,
                s_ptr,
                expert,
                offs_n + N,
                mask_n,
                k0,
                K,
                stride_be,
                stride_bn,
                stride_bk,
                stride_se,
                stride_sn,
                stride_sk,
                WFMT,
                GROUP_SIZE,
                QBLOCK_N,
                BLOCK_K,
                BLOCK_N,
            )
            acc_up = tl.dot(a, b_up.to(a.dtype), acc_up, input_precision="ieee")
    if GATED:
        if ACTIVATION == 1:  # SiTU (kernels.activation): both halves bounded by scaled tanh, in fp32
            gate = act_beta * _tanh(acc / act_beta) * tl.sigmoid(acc)
            if HAS_LINEAR_BETA:
                acc_up = act_linear_beta * _tanh(acc_up / act_linear_beta)
            acc = gate * acc_up
        else:  # SiLU
            acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & mask_n[None, :],
    )


@triton.jit
def _moe_combine_kernel(
    pairs_ptr,
    ids_ptr,
    y_ptr,
    D,
    num_experts,
    stride_p,
    stride_i,
    stride_y,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # y[t] = sum over the token's k slots of its pair rows, in slot order and fp32 (as a sum over
    # dim 1 of [T, k, D]), rounded once. Pairs computed elsewhere (id == E) were never written: they
    # are skipped here instead of zero-filled beforehand (no zeros launch, no read of zeros).
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        width = tl.where(tl.load(ids_ptr + t * stride_i + j) < num_experts, D, 0)  # 0: nothing to read
        row = tl.load(pairs_ptr + (t * TOP_K + j) * stride_p + cols, mask=cols < width, other=0.0)
        acc += row.to(tl.float32)
    tl.store(y_ptr + t * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _check_routing(x, topk_ids, topk_weights):
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor [T, D], got {tuple(x.shape)} {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be int32/int64 [T={x.shape[0]}, k], got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be float {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")


def _check_placement(x, *tensors):
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {[str(t.device) for t in (x, *tensors)]}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need a CUDA/ROCm tensor (or TRITON_INTERPRET=1), got {x.device}")
    if not all(w.is_contiguous() for w in tensors[2:]):
        raise ValueError("expert weights and scales must be contiguous")


def _act_meta(activation: GatedActivation | None) -> dict:
    # The kernel's activation arguments: the kind and whether up is bounded are compile-time (one
    # specialisation per model), the betas plain fp32 scalars.
    act = resolve(activation)
    linear_beta = act.linear_beta
    return dict(
        act_beta=float(act.beta),
        act_linear_beta=1.0 if linear_beta is None else float(linear_beta),
        ACTIVATION=act.code,
        HAS_LINEAR_BETA=linear_beta is not None,
    )


def _run(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, inter, wfmt, group_size, qblock_n=1, activation=None):
    t, d = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if num_pairs <= 64 else 64
    block_n, block_k = 64, 64
    sorted_ids, expert_ids, num_post = align_pairs(topk_ids, block_m, w13.shape[0])
    num_blocks = expert_ids.shape[0]
    routing = topk_weights.reshape(-1).contiguous()  # [T*k]
    hidden = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # act(gate, up)
    # rows of pairs computed elsewhere (id == E) are never written; the combine skips them
    out = torch.empty((num_pairs, d), dtype=torch.float32, device=x.device)
    s13 = w13 if w13_scale is None else w13_scale  # dummy pointer for dense weights
    s2 = w2 if w2_scale is None else w2_scale
    meta = dict(
        WFMT=wfmt,
        GROUP_SIZE=group_size,
        QBLOCK_N=qblock_n,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **_act_meta(activation),
    )

    def scale_strides(s, dense):
        return (0, 0, 0) if dense else (s.stride(0), s.stride(1), s.stride(2))

    _fused_moe_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x,
        w13,
        s13,
        hidden,
        routing,
        sorted_ids,
        expert_ids,
        num_post,
        inter,
        d,
        num_pairs,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        *scale_strides(s13, w13_scale is None),
        hidden.stride(0),
        hidden.stride(1),
        TOP_K=top_k,
        GATED=True,
        MUL_ROUTED_WEIGHT=False,
        **meta,
    )
    _fused_moe_kernel[(num_blocks, triton.cdiv(d, block_n))](
        hidden,
        w2,
        s2,
        out,
        routing,
        sorted_ids,
        expert_ids,
        num_post,
        d,
        inter,
        num_pairs,
        hidden.stride(0),
        hidden.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        *scale_strides(s2, w2_scale is None),
        out.stride(0),
        out.stride(1),
        TOP_K=1,
        GATED=False,
        MUL_ROUTED_WEIGHT=True,
        **meta,
    )
    return moe_combine(out, topk_ids, w13.shape[0], x.dtype)  # [T, D]


def moe_combine(pairs: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's sum over its k slots of the weighted expert rows ``pairs [T*k, D]`` (fp32, row
    ``t*k + j`` for slot j of token t), cast to ``dtype`` -> [T, D]. Slots whose id is ``num_experts``
    (computed elsewhere) are skipped: their rows are never read. One launch (op by op: zeros for the
    skipped rows, a sum and a cast)."""
    t, top_k = topk_ids.shape
    if pairs.dim() != 2 or pairs.shape[0] != t * top_k or pairs.stride(-1) != 1:
        raise ValueError(
            f"moe_combine: pairs must be [T*k={t * top_k}, D] with a contiguous last dim, got {tuple(pairs.shape)}"
        )
    d = pairs.shape[1]
    y = torch.empty((t, d), dtype=dtype, device=pairs.device)
    ids = topk_ids if topk_ids.stride(-1) == 1 else topk_ids.contiguous()
    check_device(pairs, ids)
    if t and d:
        block_d = min(1024, triton.next_power_of_2(d))
        _moe_combine_kernel[(t, triton.cdiv(d, block_d))](
            pairs,
            ids,
            y,
            d,
            num_experts,
            pairs.stride(0),
            ids.stride(0),
            y.stride(0),
            TOP_K=top_k,
            BLOCK_D=block_d,
        )
    return y


def _check_shapes(expected: dict):
    for name, (tensor, shape, dtypes) in expected.items():
        if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
            names = "/".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name} must be {names} {list(shape)}, got {tuple(tensor.shape)} {tensor.dtype}")


def fused_moe(x, topk_ids, topk_weights, w13, w2, activation: GatedActivation | None = None) -> torch.Tensor:
    """Gated MoE over dense experts: x [T, D], w13 [E, 2I, D] (gate rows, then up), w2 [E, D, I] -> [T, D].
    ``activation``: SiLU (None) or SiTU, here and in the other formats' functions."""
    _check_routing(x, topk_ids, topk_weights)
    if w13.dim() != 3 or w13.shape[2] != x.shape[1] or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, D={x.shape[1]}], got {tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    _check_shapes(
        {
            "w13": (w13, (e, 2 * inter, x.shape[1]), FLOAT_DTYPES),
            "w2": (w2, (e, x.shape[1], inter), FLOAT_DTYPES),
        }
    )
    _check_placement(x, topk_ids, topk_weights, w13, w2)
    return _run(x, topk_ids, topk_weights, w13, w2, None, None, inter, DENSE, 1, activation=activation)


def fused_moe_w4a16(
    x,
    topk_ids,
    topk_weights,
    w13_packed,
    w13_scale,
    w2_packed,
    w2_scale,
    group_size: int = 32,
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """Gated MoE over INT4 experts (compressed-tensors pack-quantized).

    w13_packed int32 [E, 2I, ceil(D/8)], w13_scale [E, 2I, ceil(D/g)], w2_packed int32
    [E, D, ceil(I/8)], w2_scale [E, D, ceil(I/g)] -> [T, D] in x.dtype.
    """
    _check_routing(x, topk_ids, topk_weights)
    t, d = x.shape
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if w13_packed.dim() != 3 or w13_packed.shape[1] % 2 or w13_packed.shape[2] != -(-d // 8):
        raise ValueError(f"w13_packed must be [E, 2I, ceil(D/8)={-(-d // 8)}], got {tuple(w13_packed.shape)}")
    e, inter = w13_packed.shape[0], w13_packed.shape[1] // 2
    i32 = (torch.int32,)
    _check_shapes(
        {
            "w13_packed": (w13_packed, (e, 2 * inter, -(-d // 8)), i32),
            "w13_scale": (w13_scale, (e, 2 * inter, -(-d // group_size)), FLOAT_DTYPES),
            "w2_packed": (w2_packed, (e, d, -(-inter // 8)), i32),
            "w2_scale": (w2_scale, (e, d, -(-inter // group_size)), FLOAT_DTYPES),
        }
    )
    _check_placement(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    return _run(
        x,
        topk_ids,
        topk_weights,
        w13_packed,
        w2_packed,
        w13_scale,
        w2_scale,
        inter,
        INT4,
        group_size,
        activation=activation,
    )


def fused_moe_mxfp4(
    x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation: GatedActivation | None = None
) -> torch.Tensor:
    """Gated MoE over OCP MXFP4 experts: w13_packed uint8 [E, 2I, D/2], w13_scale uint8 E8M0
    [E, 2I, D/32]; w2_packed uint8 [E, D, I/2], w2_scale uint8 [E, D, I/32] -> [T, D] in x.dtype."""
    _check_routing(x, topk_ids, topk_weights)
    d = x.shape[1]
    if w13_packed.dim() != 3 or w13_packed.shape[1] % 2:
        raise ValueError(f"w13_packed must be uint8 [E, 2I, D/2], got {tuple(w13_packed.shape)}")
    e, inter = w13_packed.shape[0], w13_packed.shape[1] // 2
    if d % MXFP4_BLOCK or inter % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 experts need D ({d}) and I ({inter}) to be multiples of {MXFP4_BLOCK}")
    u8 = (torch.uint8,)
    _check_shapes(
        {
            "w13_packed": (w13_packed, (e, 2 * inter, d // 2), u8),
            "w13_scale": (w13_scale, (e, 2 * inter, d // MXFP4_BLOCK), u8),
            "w2_packed": (w2_packed, (e, d, inter // 2), u8),
            "w2_scale": (w2_scale, (e, d, inter // MXFP4_BLOCK), u8),
        }
    )
    _check_placement(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    return _run(
        x,
        topk_ids,
        topk_weights,
        w13_packed,
        w2_packed,
        w13_scale,
        w2_scale,
        inter,
        MXFP4,
        MXFP4_BLOCK,
        activation=activation,
    )


def fused_moe_fp8(
    x,
    topk_ids,
    topk_weights,
    w13,
    w13_scale_inv,
    w2,
    w2_scale_inv,
    block=(128, 128),
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """Gated MoE over block-FP8 experts: w13 e4m3fn [E, 2I, D] + fp32 scale_inv [E, 2I/bn, D/bk]
    (ceil), w2 e4m3fn [E, D, I] + scale_inv [E, D/bn, I/bk] -> [T, D] in x.dtype."""
    _check_routing(x, topk_ids, topk_weights)
    d = x.shape[1]
    bn, bk = block
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be float8_e4m3fn [E, 2I, D], got {tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if inter % bn:
        # gate and up rows of w13 share scale rows only when I falls on a block boundary
        raise ValueError(f"FP8 experts need I ({inter}) divisible by the block's N side ({bn})")
    fp8, f32 = (torch.float8_e4m3fn,), (torch.float32,)
    _check_shapes(
        {
            "w13": (w13, (e, 2 * inter, d), fp8),
            "w13_scale_inv": (w13_scale_inv, (e, 2 * inter // bn, -(-d // bk)), f32),
            "w2": (w2, (e, d, inter), fp8),
            "w2_scale_inv": (w2_scale_inv, (e, -(-d // bn), -(-inter // bk)), f32),
        }
    )
    _check_placement(x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv)
    return _run(
        x, topk_ids, topk_weights, w13, w2, w13_scale_inv, w2_scale_inv, inter, FP8, bk, bn, activation=activation
    )
