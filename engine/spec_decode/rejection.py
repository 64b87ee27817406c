"""Verification of draft tokens: which drafts the target accepts, and the one token after them.

Sequence i brings k_i drafts and k_i + 1 consecutive rows of target logits: row j scores the token
at draft position j, the last row the token after all drafts (the bonus). The output of each
sequence is its accepted drafts followed by exactly one token of the target's own.

- Greedy sequences (temperature 0): accept while the draft equals the row's argmax; then the argmax.
- Teacher-forced rows (``SamplingBatch.forced``): accept while the draft equals the forced token;
  then the forced token. The rule above still draws its randomness, so nothing else shifts.
- Sampled sequences (standard speculative sampling; Leviathan et al. 2023, Chen et al. 2023, vLLM's
  ``v1/sample/rejection_sampler.py``): with target p (the row's logits / temperature, top-k and
  top-p masked exactly as ``engine/sampling/sampler.py`` samples) and draft probabilities q, accept
  draft x with probability min(1, p(x) / q(x)); at the first rejection draw from
  norm(max(0, p - q)); after k accepted drafts draw the bonus from p. Deterministic drafters
  (n-gram, suffix, greedy EAGLE) have q = one-hot(x): accept with probability p(x), and on rejection
  draw from p with x removed. Either way every output token is distributed exactly as the target's.
- ``method="block"`` (vLLM's ``rejection_sample_method: "block"``): sampled sequences keep as many
  drafts as block verification decides (``block_verify.py``; Sun et al. 2024), the same randomness
  and the same exactness, and at least as many drafts kept in expectation. Greedy and teacher-forced
  sequences follow the rules above under either method.

Randomness: one uniform per draft and one exponential-race noise row per sequence (the final
draw, as the sampler does). Seeded sequences draw theirs from their own generator in a fixed
order (k_i uniforms, then one vocabulary row of noise), so their output never depends on what they
are batched with; with no drafts that is exactly what ``sample`` draws, token for token.

Everything runs on the logits' device with no host sync; the host lists go over in one copy.
"""

from __future__ import annotations

import itertools

import torch

from kimitui.engine.sampling.sampler import SamplingBatch, apply_top_k_top_p, row_argmax
from kimitui.engine.spec_decode.block_verify import block_accept

METHODS = ("standard", "block")


def _accept_prob(p_draft: torch.Tensor, q_draft: torch.Tensor | None) -> torch.Tensor:
    """Acceptance probability of each draft from its target probability p(x) and draft
    probability q(x) (None: one-hot drafts, q(x) = 1). [N, K] -> [N, K]"""
    if q_draft is None:
        return p_draft
    return torch.where(q_draft > 0, (p_draft / q_draft).clamp(max=1.0), torch.ones_like(p_draft))


def _residual(p_rows: torch.Tensor, q_rows: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """The (unnormalised) distribution to draw from after rejecting ``drafts``: max(0, p - q), or
    p without the draft for one-hot drafts. [N, V] -> [N, V]"""
    if q_rows is None:
        return p_rows.scatter(1, drafts[:, None], 0.0)
    return (p_rows - q_rows).clamp(min=0.0)


def _target_probs(logits: torch.Tensor, batch: SamplingBatch, seq_of_row: torch.Tensor) -> torch.Tensor:
    """The sampler's distribution for every row: logits / temperature, then top-k / top-p. [R, V]"""
    temp = batch.temperature[seq_of_row]
    scaled = logits / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    if batch.use_top_k or batch.use_top_p:
        scaled = apply_top_k_top_p(
            scaled,
            batch.top_k[seq_of_row] if batch.use_top_k else None,
            batch.top_p[seq_of_row] if batch.use_top_p else None,
        )
    return scaled.softmax(dim=-1)


def _check(logits, num_drafts, draft_token_ids, batch, draft_probs) -> None:
    n = len(num_drafts)
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"rejection_sample: logits must be a float [R, V] tensor, got {tuple(logits.shape)} {logits.dtype}"
        )
    if any(k < 0 for k in num_drafts):
        raise ValueError(f"rejection_sample: negative draft count in num_drafts {num_drafts}")
    if len(draft_token_ids) != n or any(len(d) != k for d, k in zip(draft_token_ids, num_drafts)):
        raise ValueError(
            f"rejection_sample: draft_token_ids lengths {[len(d) for d in draft_token_ids]} "
            f"do not match num_drafts {num_drafts}"
        )
    rows = sum(num_drafts) + n
    if logits.shape[0] != rows:
        raise ValueError(f"rejection_sample: logits has {logits.shape[0]} rows, expected sum(k_i + 1) = {rows}")
    if batch.temperature.shape[0] != n or len(batch.generators) != n:
        raise ValueError(
            f"rejection_sample: the SamplingBatch has {batch.temperature.shape[0]} rows and "
            f"{len(batch.generators)} generators, expected one per sequence ({n})"
        )
    vocab = logits.shape[1]
    if any(not 0 <= t < vocab for d in draft_token_ids for t in d):
        raise ValueError(f"rejection_sample: a draft token id is outside the vocabulary [0, {vocab})")
    if draft_probs is not None and tuple(draft_probs.shape) != (sum(num_drafts), vocab):
        raise ValueError(
            f"rejection_sample: draft_probs must be [sum k_i, V] = [{sum(num_drafts)}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )


def rejection_sample(
    logits: torch.Tensor,
    num_drafts: list[int],
    draft_token_ids: list[list[int]],
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None = None,
    method: str = "standard",
) -> torch.Tensor:
    """Verify every sequence's drafts. logits: [sum(k_i + 1), V] (fp32; other float types are
    upcast); batch: one entry per sequence; draft_probs: [sum k_i, V] or None (one-hot drafts).
    Returns [N, max_k + 1] int64 on the logits' device: row i is sequence i's accepted drafts, then
    one target token, then -1 padding (``to_lists`` reads it back). ``batch.penalties``, when set,
    indexes the logits rows (row j of a sequence counts its drafts before j as output).
    ``method``: ``standard`` (per-token) or ``block`` (block verification of sampled sequences)."""
    if method not in METHODS:
        raise ValueError(f"rejection_sample: method {method!r}: supported {', '.join(METHODS)}")
    _check(logits, num_drafts, draft_token_ids, batch, draft_probs)
    device = logits.device
    logits = logits.float()
    if batch.penalties is not None:  # one penalty row per logits row (see engine/sampling/penalties.py)
        logits = batch.penalties.apply(logits)
    n, vocab = len(num_drafts), logits.shape[1]
    max_k = max(num_drafts, default=0)
    # The host sends k_i and the drafts in one copy; the layout is derived on the device:
    # row_of[i, j]: the logits row scoring position j of sequence i (its bonus row past k_i);
    # q_of[i, j]: the flat draft index of that position (clamped, used only where j < k_i).
    total = sum(num_drafts)
    if draft_probs is not None and total == 0:
        draft_probs = None  # nothing was drafted: nothing to read from it
    if draft_probs is not None:
        draft_probs = draft_probs.float()
    packed = torch.tensor(
        list(num_drafts) + list(itertools.chain.from_iterable(draft_token_ids)) + [0], dtype=torch.int64
    ).to(device, non_blocking=True)
    k_t, flat_drafts = packed[:n], packed[n:]  # flat_drafts: [total + 1], a 0 pad so it is never empty
    positions = torch.arange(max_k + 1, device=device)
    q_start = torch.cumsum(k_t, 0) - k_t  # [N]
    row_of_t = (q_start + torch.arange(n, device=device))[:, None] + torch.minimum(positions[None, :], k_t[:, None])
    q_of_t = (q_start[:, None] + positions[None, :]).clamp(max=max(total - 1, 0))  # [N, max_k + 1]
    # the sequence of each logits row: [R] (searchsorted, unlike repeat_interleave, never sizes on the host)
    seq_of_row_t = torch.searchsorted(torch.cumsum(k_t + 1, 0), torch.arange(total + n, device=device), right=True)
    drafts_t = flat_drafts[q_of_t[:, :max_k]]  # [N, max_k]; entries past k_i are never read as drafts

    greedy_seq = batch.temperature == 0  # [N]
    draft_rows = row_of_t[:, :max_k]  # [N, max_k]
    is_draft = positions[None, :max_k] < k_t[:, None]  # [N, max_k]

    accept_greedy = row_argmax(logits)[draft_rows] == drafts_t  # [N, max_k]
    if batch.all_greedy:
        accept = accept_greedy
        probs = None
    else:
        probs = _target_probs(logits, batch, seq_of_row_t)  # [R, V]
        p_draft = probs[draft_rows, drafts_t]  # [N, max_k]
        q_draft = None if draft_probs is None else draft_probs[q_of_t[:, :max_k], drafts_t]
        uniform = torch.rand(n, max_k, device=device)
        noise = torch.empty(n, vocab, device=device).exponential_()
        for i, gen in enumerate(batch.generators):
            if gen is not None:  # own stream, fixed order: k_i uniforms, then a row of noise
                uniform[i, : num_drafts[i]].uniform_(generator=gen)
                noise[i].exponential_(generator=gen)
        accept_sampled = uniform < _accept_prob(p_draft, q_draft)
        accept = torch.where(greedy_seq[:, None], accept_greedy, accept_sampled)
    forced = batch.forced  # [R] teacher-forced tokens (-1: free): a draft is accepted iff it is the forced token
    if forced is not None:
        f_draft = forced[draft_rows]
        accept = torch.where(f_draft >= 0, f_draft == drafts_t, accept)
    # number of leading accepted drafts per sequence: [N]
    num_accepted = (accept & is_draft).to(torch.int64).cumprod(dim=1).sum(dim=1)
    weight = None  # block verification: the weight of p in the residual after the kept drafts
    if method == "block" and probs is not None and max_k:
        tau, w_tau = block_accept(probs, draft_probs, p_draft, q_draft, k_t, q_of_t, uniform)
        per_token = greedy_seq
        if forced is not None:  # a teacher-forced sequence keeps the per-position rule
            per_token = per_token | ((forced[draft_rows] >= 0) & is_draft).any(dim=1)
        num_accepted = torch.where(per_token, num_accepted, tau)
        weight = torch.where(per_token, torch.ones_like(w_tau), w_tau)

    final_row = row_of_t.gather(1, num_accepted[:, None])[:, 0]  # [N]: first rejected or bonus row
    final = row_argmax(logits[final_row])
    if probs is not None:
        p_final = probs[final_row]  # [N, V]
        rejected = num_accepted < k_t
        rejected_draft = (
            drafts_t.gather(1, num_accepted.clamp(max=max(max_k - 1, 0))[:, None])[:, 0] if max_k else final
        )
        q_final = None if draft_probs is None else draft_probs[q_of_t.gather(1, num_accepted[:, None])[:, 0]]
        p_scaled = p_final if weight is None else p_final * weight[:, None]
        residual = torch.where(rejected[:, None], _residual(p_scaled, q_final, rejected_draft), p_final)
        # p == q on the support leaves nothing to draw from; rejection then had probability 0 (up
        # to rounding), and p is the right fallback.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_final)
        sampled = row_argmax(residual / noise)
        final = torch.where(greedy_seq, final, sampled)

    if forced is not None:
        f_final = forced[final_row]
        final = torch.where(f_final >= 0, f_final, final)

    out = torch.where(positions[None, :max_k] < num_accepted[:, None], drafts_t, -1)
    out = torch.cat([out, torch.full((n, 1), -1, dtype=torch.int64, device=device)], dim=1)
    return out.scatter_(1, num_accepted[:, None], final[:, None])


def draft_probs(sample_seqs, drafts: list[list[int]], vocab: int) -> torch.Tensor | None:
    """[sum k_i, V] the draft distributions of this step's drafts, one-hot rows for drafts without
    one (deterministic proposers); None when no sequence brought any (the one-hot rule then)."""
    if not any(d and getattr(s.seq, "spec_draft_probs", None) is not None for s, d in zip(sample_seqs, drafts)):
        return None
    rows = []
    for s, d in zip(sample_seqs, drafts):
        if not d:
            continue
        q = getattr(s.seq, "spec_draft_probs", None)
        if q is not None and q.shape[0] >= len(d) and q.shape[-1] == vocab:
            rows.append(q[: len(d)].float())
        else:
            ids = torch.tensor(d, dtype=torch.int64)
            rows.append(torch.nn.functional.one_hot(ids, vocab).float())
    device = next((r.device for r in rows if r.device.type != "cpu"), rows[0].device)
    return torch.cat([r.to(device) for r in rows])


def to_lists(out: torch.Tensor) -> list[list[int]]:
    """``rejection_sample``'s output as one list of tokens per sequence, in one device->host copy."""
    rows = out.tolist()
    return [row[: row.index(-1)] if -1 in row else row for row in rows]
