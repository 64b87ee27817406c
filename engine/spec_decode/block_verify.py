"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025,
arXiv 2403.10444, Algorithm 2): how many of a sequence's drafts to keep, decided over the whole block.

The per-token rule keeps the longest prefix whose every draft passed its own min(1, p / q) test.
Block verification instead carries a running weight through the block and may keep a prefix past a
draft the per-token rule would have rejected. It is exact (every emitted sequence of tokens is
distributed as the target's) and keeps at least as many drafts in expectation (the paper's
Theorem 2; tests/engine/spec_decode/test_block_verify.py measures both).

For one sequence with drafts x_1..x_k, target distributions P_0..P_k (P_i: the distribution of the
token after i drafts; P_k the bonus row) and draft distributions Q_0..Q_{k-1}:

    w_0 = 1,  w_i = min(1, w_{i-1} * P_{i-1}(x_i) / Q_{i-1}(x_i))                  (i = 1..k)
    r_i = sum_v max(0, w_i P_i(v) - Q_i(v))                                         (i < k)
    h_i = r_i / (r_i + 1 - w_i) for i < k (0 where r_i = 0),  h_k = w_k
    tau = the largest i in 1..k with eta_i < h_i (eta_i uniform), else 0

The sequence keeps x_1..x_tau and then draws one token: from norm(max(0, w_tau P_tau - Q_tau)) when
tau < k, from P_k when tau = k. One-hot drafts (a deterministic proposer: Q_i = one-hot(x_{i+1}))
give r_i = w_i (1 - P_i(x_{i+1})) and the residual P_tau without x_{tau+1}, as the per-token rule's.
With temperature 0 the target is one-hot and the rule reduces to "keep while the draft is the
argmax", which ``rejection.py`` applies directly to greedy sequences.

The randomness is the per-token rule's (one uniform per draft), so seeded sequences draw the same
stream under either rule. Vectorised over the batch; the only loop is over the draft length (the
running weight), with no host sync.
"""

from __future__ import annotations

import torch


def block_accept(
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    p_draft: torch.Tensor,
    q_draft: torch.Tensor | None,
    k_t: torch.Tensor,
    q_of_t: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau [N] int64: the drafts kept per sequence, w_tau [N]: the weight of the residual to draw
    from when tau < k). ``probs`` [R, V] the target's distributions (rows laid out as in
    ``rejection_sample``); ``draft_probs`` [sum k, V] or None (one-hot drafts); ``p_draft`` /
    ``q_draft`` [N, K]: P and Q of each draft (q None: one-hot); ``k_t`` [N] draft counts;
    ``q_of_t`` [N, K + 1] the flat draft index of each position; ``uniform`` [N, K]."""
    n, max_k = p_draft.shape
    device = p_draft.device
    if max_k == 0:
        return torch.zeros(n, dtype=torch.int64, device=device), torch.ones(n, device=device)
    if q_draft is None:
        ratio = p_draft
    else:
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=torch.finfo(q_draft.dtype).tiny), 1.0)
    weights = [torch.ones(n, device=device)]
    for j in range(max_k):  # the running weight: a recurrence over the draft length only
        weights.append(torch.clamp(weights[-1] * ratio[:, j], max=1.0))
    w = torch.stack(weights, dim=1)  # [N, K + 1]: w[:, i] = w_i
    # r_i for i = 0..K-1 (position i: the distribution of draft i + 1)
    if draft_probs is None:
        r = w[:, :max_k] * (1.0 - p_draft)
    else:
        total = draft_probs.shape[0]
        q_start = torch.cumsum(k_t, 0) - k_t
        seq_of_draft = torch.searchsorted(torch.cumsum(k_t, 0), torch.arange(total, device=device), right=True)
        pos_of_draft = torch.arange(total, device=device) - q_start[seq_of_draft]
        w_flat = w[seq_of_draft, pos_of_draft]  # [total]
        # draft t of sequence s is scored by logits row t + s (each earlier sequence adds a bonus row)
        rows = probs[torch.arange(total, device=device) + seq_of_draft]  # a copy: updated in place
        r_flat = rows.mul_(w_flat[:, None]).sub_(draft_probs).clamp_(min=0.0).sum(dim=-1)
        r = r_flat[q_of_t[:, :max_k]]  # [N, K]; entries past k_i are never read
    i = torch.arange(1, max_k + 1, device=device)[None, :]  # [1, K]: i = 1..K
    k = k_t[:, None]
    r_next = torch.cat([r[:, 1:], torch.zeros(n, 1, device=device)], dim=1)  # r_i for i = 1..K
    w_next = w[:, 1:]  # w_i for i = 1..K
    den = r_next + (1.0 - w_next).clamp(min=0.0)
    h_mid = torch.where(den > 0, r_next / den.clamp(min=torch.finfo(den.dtype).tiny), 0.0)
    h = torch.where(i < k, h_mid, torch.where(i == k, w_next, 0.0))
    tau = ((uniform < h).to(torch.int64) * i).amax(dim=1)
    return tau, w.gather(1, tau[:, None])[:, 0]
