"""PyTorch references (the oracle) for the fused small-op Triton kernels.

Written for clarity, op by op, on any device; each mirrors one kernel module:
``fused_add_rms_norm`` (kernels/fused_add_rms_norm.py), ``rope_mla`` (kernels/rope_fused.py),
``mla_cache_write`` (kernels/mla_cache_write.py), ``moe_route_logits`` (kernels/moe_router.py),
``moe_align_block_size`` (kernels/moe_align.py).
"""

import torch

from kernels import reference


def fused_add_rms_norm(x, residual, weight, eps=1e-6):
    """(HF RMSNorm of x + residual, x + residual): the sum rounds to x.dtype before the norm."""
    s = x + residual
    return reference.rms_norm(s, weight, eps), s


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
    c_kv = reference.rms_norm(kv[:, :r], norm_weight, eps)
    k_pe = _rope_rows(kv[:, None, r:], cos, sin, positions)[:, 0]
    flat = cache.view(-1, cache.shape[-1])
    keep = (slot_mapping >= 0) & (slot_mapping < flat.shape[0])
    flat.index_copy_(0, slot_mapping[keep].long(), torch.cat([c_kv, k_pe], dim=-1)[keep].to(cache.dtype))


def _first_topk(v, k):
    # top-k of v [T, N] along the last dim, ties to the lower index (a stable descending sort)
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :k]


def moe_route_logits(logits, bias, top_k, n_group=1, topk_group=1, scoring_func="sigmoid",
                     norm_topk_prob=True, scaling=1.0):
    """``reference.moe_route`` after the gate GEMM: logits [T, E] -> (ids [T, k] int64, weights fp32).

    Ties (equal biased scores, equal group scores) pick the lower id, as the kernel does.
    """
    logits = logits.float()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()
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
        sorted_ids[slot: slot + len(pairs)] = pairs
        tiles = -(-len(pairs) // block_size)
        expert_ids[slot // block_size: slot // block_size + tiles] = [e] * tiles
        slot += tiles * block_size
    # tiles past the last used one keep E - 1 (the PyTorch version's clamp); the GEMM skips them
    as_int32 = dict(dtype=torch.int32, device=topk_ids.device)
    return torch.tensor(sorted_ids, **as_int32), torch.tensor(expert_ids, **as_int32), torch.tensor([slot], **as_int32)
