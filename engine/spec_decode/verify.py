"""The verification step's two halves that are not scheduling: the per-position KDA layout of a
step's verified decodes, and turning the target's logits of every verified position into accepted
tokens and their log-probabilities (one device-to-host copy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimitui.engine.sampling.sampler import logprob_dicts
from kimitui.engine.spec_decode.rejection import rejection_sample


@dataclass
class KDASpecStep:
    """One verified position ``j`` across a step's decodes: ``rows`` [n] (decode rows at their j-th
    position, one per sequence that has one), and after the step the slot copies ``save_src`` ->
    ``save_dst`` [m] (each sequence with a later position keeps its state after ``j`` in a scratch slot)."""

    rows: torch.Tensor
    save_src: torch.Tensor | None
    save_dst: torch.Tensor | None


def kda_spec_steps(
    spec_lens: list[int], state_slots: list[int], scratch_base: int, num_spec_tokens: int, device: torch.device
) -> list[KDASpecStep]:
    """Position-major layout of the decode rows: ``spec_lens[i]`` rows for decoding sequence ``i``
    (laid out one sequence after another); ``state_slots`` holds a slot per decode row."""
    firsts, row = [], 0
    for n in spec_lens:
        firsts.append(row)
        row += n
    steps = []
    for j in range(max(spec_lens)):
        live = [i for i, n in enumerate(spec_lens) if n > j]
        rows = [firsts[i] + j for i in live]
        keep = [state_slots[firsts[i]] for i in live if spec_lens[i] > j + 1]
        src = torch.tensor(keep, dtype=torch.int64, device=device) if keep else None
        dst = None
        if keep:
            dst = torch.tensor([scratch_base + s * num_spec_tokens + j for s in keep], dtype=torch.int64, device=device)
        steps.append(KDASpecStep(torch.tensor(rows, dtype=torch.int64, device=device), src, dst))
    return steps


@dataclass
class KDASpecLayout:
    """The same step for a recurrence that takes every verified position in one call (fla-core's
    spec-decoding layout): ``indices`` [N, max T] int64, sequence n's state rows by position (its
    scratch rows, then its own slot last, padded with the slot); ``lengths`` its number of rows."""

    indices: torch.Tensor
    lengths: list[int]


def kda_spec_layout(
    spec_lens: list[int], state_slots: list[int], scratch_base: int, num_spec_tokens: int, device: torch.device
) -> KDASpecLayout:
    """Row n of ``indices``: where the state after each of sequence n's positions goes, the scratch
    slots ``kda_spec_steps`` keeps them in and, for the last position, the sequence's slot (from
    which it also starts: the runner restored the last accepted state there before the step)."""
    rows, first, width = [], 0, max(spec_lens)
    for n in spec_lens:
        slot = state_slots[first]
        row = [scratch_base + slot * num_spec_tokens + j for j in range(n - 1)] + [slot]
        rows.append(row + [slot] * (width - n))
        first += n
    return KDASpecLayout(torch.tensor(rows, dtype=torch.int64, device=device), list(spec_lens))


def verify_and_logprobs(
    logits: torch.Tensor,
    drafts: list[list[int]],
    batch,
    params: list,
    draft_probs: torch.Tensor | None = None,
    method: str = "standard",
):
    """Accept drafts and sample one more token per sequence; ``logits`` [R, V] fp32 hold
    ``len(drafts[i]) + 1`` rows for sequence ``i``, in order; ``draft_probs`` [sum k_i, V]: the
    distributions sampled drafts were drawn from (None: every draft a deterministic guess); ``method``:
    the rule, ``standard`` or ``block`` (``rejection_sample``). Returns
    (tokens per sequence, the log-prob dicts of those tokens per sequence or None where not asked),
    read back in one copy."""
    num_drafts = [len(d) for d in drafts]
    if draft_probs is not None:
        draft_probs = draft_probs.to(logits.device)
    out = rejection_sample(logits, num_drafts, drafts, batch, draft_probs, method)  # [N, K + 1], -1 padded
    n, width = out.shape
    cols = [out.reshape(-1).double()]
    k = max(batch.max_logprobs, 0)
    if batch.max_logprobs >= 0:
        lens = torch.tensor([d + 1 for d in num_drafts], device=logits.device)
        seq_of_row = torch.repeat_interleave(torch.arange(n, device=logits.device), lens)
        starts = lens.cumsum(0) - lens
        pos_of_row = torch.arange(logits.shape[0], device=logits.device) - starts[seq_of_row]
        tok = out[seq_of_row, pos_of_row].clamp(min=0)
        logp = logits.log_softmax(dim=-1)
        cols.append(logp.gather(1, tok[:, None])[:, 0].double())
        if k:
            top = logp.topk(k, dim=-1)
            cols += [top.indices.reshape(-1).double(), top.values.reshape(-1).double()]
    flat = torch.cat(cols).tolist()  # the one sync
    tokens = [[int(t) for t in flat[i * width : (i + 1) * width] if t >= 0] for i in range(n)]
    if batch.max_logprobs < 0:
        return tokens, [None] * n
    R = logits.shape[0]
    at = n * width
    chosen = flat[at : at + R]
    ids = flat[at + R : at + R + R * k]
    vals = flat[at + R + R * k :]
    # each sequence's output rows (its verified token and accepted drafts) as rows of the sampler's
    # log-prob dicts, built by the sampler's own helper
    lps, row = [], 0
    for i, p in enumerate(params):
        rows = range(row, row + len(tokens[i]))
        row += num_drafts[i] + 1
        if p.logprobs is None:
            lps.append(None)
            continue
        top_ids = [[int(t) for t in ids[r * k : (r + 1) * k]] for r in rows] if k else None
        top_vals = [vals[r * k : (r + 1) * k] for r in rows] if k else None
        lps.append(logprob_dicts([p] * len(rows), tokens[i], [chosen[r] for r in rows], top_ids, top_vals))
    return tokens, lps
