"""Temporary greedy-only verification (replaced by the full rule)."""

from __future__ import annotations

import torch


def rejection_sample(logits, num_drafts, draft_token_ids, batch, draft_probs=None):
    n, K = len(num_drafts), max(num_drafts) + 1
    out = torch.full((n, K), -1, dtype=torch.int64, device=logits.device)
    greedy = logits.argmax(-1).tolist()
    row = 0
    for i, k in enumerate(num_drafts):
        j = 0
        while j < k and draft_token_ids[i][j] == greedy[row + j]:
            out[i, j] = greedy[row + j]
            j += 1
        out[i, j] = greedy[row + j]
        row += k + 1
    return out
