"""MoE routing after the gate GEMM in one Triton launch (reference: ``reference.moe_route_logits``).

DeepSeek-V3's ``noaux_tc`` router, as Kimi K2 uses it: scores = sigmoid(logits) (or softmax);
selection runs on ``scores + e_score_correction_bias``; with ``n_group > 1`` each group scores the
sum of its two best biased experts and only the ``topk_group`` best groups stay eligible; the
``top_k`` best eligible experts win; their weights are the *unbiased* scores, renormalised to sum to
one (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``. Same maths as vLLM's
``grouped_topk`` (vllm-project/vllm, ``vllm/model_executor/layers/fused_moe/router/
grouped_topk_router.py``). Op by op this is about eleven launches per layer; here one program per
token holds the token's E logits in registers and selects by repeated arg-max, so ties always pick
the lower expert (or group) id, the same on every backend and every run.
"""

import torch

import triton
import triton.language as tl
from kimitui.kernels.triton.common import FLOAT_DTYPES, check_device

_MAX_EXPERTS = 4096  # one row of logits in one block


@triton.jit
def _first_argmax(v, idx, avail, BIG: tl.constexpr):
    # (max, lowest index holding it) of v [B] over the lanes in ``avail``; an explicit tie rule
    # rather than tl.argmax's. v holds no NaN (the caller maps them to -inf), so while any lane is
    # available the index is one of them, even when all are -inf: never BIG, never out of range.
    v = tl.where(avail, v, float("-inf"))
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where(avail & (v == m), idx, BIG), axis=0)


@triton.jit
def _moe_router_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    counts_ptr,
    count_rows_ptr,
    E,
    stride_l,
    stride_i,
    stride_w,
    scaling,
    TOP_K: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SOFTMAX: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    COUNT: tl.constexpr,
    ROW_MASK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=valid, other=float("-inf")).to(tl.float32)  # [BE]
    neg_inf = float("-inf")
    # NaN-safe (reference.moe_route_logits): a NaN logit counts as -inf, a NaN score as 0 (a row of
    # -inf under softmax), a NaN biased score as -inf. A NaN row then routes to valid experts
    # (the lowest ids among equals) with weight 0, instead of an id past E.
    x = tl.where(x == x, x, neg_inf)
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    else:
        scores = tl.sigmoid(x)
    scores = tl.where(scores == scores, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid & (choice == choice), choice, neg_inf)

    if N_GROUP > 1:
        # group score = sum of the group's two best biased experts; keep the TOPK_GROUP best groups
        group_size = E // N_GROUP
        group = e // group_size
        g = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), neg_inf, tl.float32)
        for gi in tl.static_range(N_GROUP):
            in_group = valid & (group == gi)
            best, at = _first_argmax(choice, e, in_group, BLOCK_E)
            second = tl.max(tl.where(in_group & (e != at), choice, neg_inf), axis=0)
            group_scores = tl.where(g == gi, best + second, group_scores)
        keep = e < 0  # all False [BE]
        group_avail = g < N_GROUP
        for _ in tl.static_range(TOPK_GROUP):
            _, gbest = _first_argmax(group_scores, g, group_avail, BLOCK_G)
            keep = keep | (group == gbest)
            group_avail = group_avail & (g != gbest)
        choice = tl.where(keep & valid, choice, neg_inf)

    k = tl.arange(0, BLOCK_K)
    top_ids = tl.zeros((BLOCK_K,), tl.int32)
    top_w = tl.zeros((BLOCK_K,), tl.float32)
    avail = valid  # experts not yet chosen (ties at -inf still pick distinct valid ids)
    for j in tl.static_range(TOP_K):
        _, at = _first_argmax(choice, e, avail, BLOCK_E)
        w = tl.sum(tl.where(e == at, scores, 0.0), axis=0)  # the unbiased score of the winner
        top_ids = tl.where(k == j, at, top_ids)
        top_w = tl.where(k == j, w, top_w)
        avail = avail & (e != at)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    mask_k = k < TOP_K
    tl.store(ids_ptr + t * stride_i + k, top_ids.to(ids_ptr.dtype.element_ty), mask=mask_k)
    # weights round once, from fp32, to the dtype asked for (the experts' activation dtype)
    tl.store(weights_ptr + t * stride_w + k, (top_w * scaling).to(weights_ptr.dtype.element_ty), mask=mask_k)
    if COUNT:  # routing statistics: a token's k experts are distinct; tokens add up atomically
        one = tl.full((BLOCK_K,), 1, tl.int32)
        if ROW_MASK:  # a graph's padding rows and capture warm-ups read 0 here: they add 0
            one = one * (tl.load(count_rows_ptr + t) != 0).to(tl.int32)
        tl.atomic_add(counts_ptr + top_ids, one.to(counts_ptr.dtype.element_ty), mask=mask_k)


def moe_route_logits(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    scoring_func: str = "sigmoid",
    norm_topk_prob: bool = True,
    scaling: float = 1.0,
    ids_dtype: torch.dtype = torch.int64,
    weights_dtype: torch.dtype = torch.float32,
    counts: torch.Tensor | None = None,
    count_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` (the gate GEMM's output) -> ``(topk_ids [T, k], topk_weights [T, k])``.

    ``bias``: the fp32 ``e_score_correction_bias [E]`` (None: no bias). Ids come in descending order
    of biased score, ties to the lower id. Weights are computed in fp32 and stored in
    ``weights_dtype``. ``counts``: None, or an int32/int64 ``[E]`` tensor to which each chosen expert
    adds one (routing statistics, in the same launch). ``count_rows``: None (every row counts), or an
    integer ``[>= T]`` tensor whose row t, when 0, keeps token t out of ``counts`` (the padding rows
    of a decode graph and its capture warm-ups). One launch, no host sync.
    """
    if logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES or logits.stride(-1) != 1:
        raise ValueError(
            f"moe_route_logits: logits must be fp16/bf16/fp32 [T, E] with a contiguous last dim, "
            f"got {logits.dtype} {tuple(logits.shape)}"
        )
    t, e = logits.shape
    if bias is not None and (bias.shape != (e,) or not bias.dtype.is_floating_point or not bias.is_contiguous()):
        raise ValueError(
            f"moe_route_logits: bias must be a contiguous float [E={e}], got {bias.dtype} {tuple(bias.shape)}"
        )
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_route_logits: scoring_func must be sigmoid or softmax, got {scoring_func!r}")
    if triton.next_power_of_2(e) > _MAX_EXPERTS:
        raise ValueError(f"moe_route_logits: {e} experts do not fit one block ({_MAX_EXPERTS})")
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"moe_route_logits: n_group={n_group} must divide E={e}, topk_group={topk_group} in [1, n_group]"
        )
    if n_group > 1 and e // n_group < 2:
        raise ValueError(f"moe_route_logits: groups score their two best experts; E/n_group={e // n_group} < 2")
    if not 1 <= top_k <= topk_group * (e // n_group):
        raise ValueError(
            f"moe_route_logits: top_k={top_k} must be in [1, {topk_group * (e // n_group)}] "
            f"(experts in the {topk_group} kept groups)"
        )
    if ids_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_route_logits: ids_dtype must be int32 or int64, got {ids_dtype}")
    if weights_dtype not in FLOAT_DTYPES:
        raise ValueError(f"moe_route_logits: weights_dtype must be fp16/bf16/fp32, got {weights_dtype}")
    if counts is not None and (
        counts.shape != (e,) or counts.dtype not in (torch.int32, torch.int64) or not counts.is_contiguous()
    ):
        raise ValueError(
            f"moe_route_logits: counts must be a contiguous int32/int64 [E={e}], got {counts.dtype} "
            f"{tuple(counts.shape)}"
        )
    if count_rows is not None and (
        count_rows.dim() != 1
        or count_rows.shape[0] < t
        or count_rows.dtype.is_floating_point
        or not count_rows.is_contiguous()
    ):
        raise ValueError(
            f"moe_route_logits: count_rows must be a contiguous integer [>= T={t}], got "
            f"{count_rows.dtype} {tuple(count_rows.shape)}"
        )
    ids = torch.empty((t, top_k), dtype=ids_dtype, device=logits.device)
    weights = torch.empty((t, top_k), dtype=weights_dtype, device=logits.device)
    check_device(
        logits,
        ids,
        *([] if bias is None else [bias]),
        *([] if counts is None else [counts]),
        *([] if count_rows is None else [count_rows]),
    )
    row_mask = counts is not None and count_rows is not None
    if t:
        _moe_router_kernel[(t,)](
            logits,
            logits if bias is None else bias,
            ids,
            weights,
            ids if counts is None else counts,
            count_rows if row_mask else ids,
            e,
            logits.stride(0),
            ids.stride(0),
            weights.stride(0),
            float(scaling),
            TOP_K=top_k,
            N_GROUP=n_group,
            TOPK_GROUP=topk_group,
            SOFTMAX=scoring_func == "softmax",
            RENORMALIZE=bool(norm_topk_prob),
            HAS_BIAS=bias is not None,
            COUNT=counts is not None,
            ROW_MASK=row_mask,
            BLOCK_E=triton.next_power_of_2(e),
            BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_G=triton.next_power_of_2(n_group),
        )
    return ids, weights
