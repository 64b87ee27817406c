"""The logits rows of a step's sampling and what each row carries.

A sampling sequence has one logits row, a verifying decode ``1 + len(drafts)`` rows (row ``j``
scores the token after the first ``j`` drafts), and a forked sample (engine/scheduler/forks.py) a copy of its
leader's row appended after the others. Penalties and teacher-forced tokens are given per row.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kimitui.engine.sampling.penalties import PenaltyBatch
from kimitui.engine.scheduler.output import ScheduledSeq


def _rows(sample_seqs: list[ScheduledSeq], drafts: list[list[int]] | None) -> Iterator[tuple[ScheduledSeq, list[int]]]:
    """Each logits row as (its sequence, the drafts before it)."""
    for i, s in enumerate(sample_seqs):
        ds = drafts[i] if drafts is not None else []
        for j in range(len(ds) + 1):
            yield s, ds[:j]


def fork_rows(logits: torch.Tensor, sample_seqs: list[ScheduledSeq], forks: list[ScheduledSeq]) -> torch.Tensor:
    """The logits with one more row per forked child: a copy of its leader's row (a leader that
    forks samples its first token, so it has exactly one row; a verifying decode before it has
    ``1 + len(drafts)``)."""
    row, rows = 0, {}
    for s in sample_seqs:
        rows[s.seq.seq_id] = row
        row += len(s.spec_token_ids) + 1
    idx = torch.tensor([rows[f.fork_of] for f in forks], dtype=torch.int64, device=logits.device)
    return torch.cat([logits, logits.index_select(0, idx)])


def penalty_rows(
    sample_seqs: list[ScheduledSeq], drafts: list[list[int]] | None, vocab_size: int, device: torch.device
) -> PenaltyBatch | None:
    """The penalties of every row: row ``j`` of a verifying decode counts the output plus the first
    ``j`` drafts as its history (what vLLM's rejection sampler does)."""
    rows = list(_rows(sample_seqs, drafts))
    return PenaltyBatch.build(
        list(range(len(rows))),
        [s.seq.sampling_params for s, _ in rows],
        [s.seq.prompt_token_ids for s, _ in rows],
        [s.seq.output_token_ids + ds for s, ds in rows],
        vocab_size,
        device,
    )


def forced_rows(sample_seqs: list[ScheduledSeq]) -> list[int] | None:
    """Teacher-forced token per row, -1 where the sampler chooses; None when no sequence forces."""
    if not any(getattr(s.seq.sampling_params, "forced_token_ids", None) for s in sample_seqs):
        return None
    out = []
    for s, ds in _rows(sample_seqs, [list(s.spec_token_ids) for s in sample_seqs]):
        forced = getattr(s.seq.sampling_params, "forced_token_ids", None) or []
        at = s.seq.num_output_tokens + len(ds)
        out.append(forced[at] if at < len(forced) else -1)
    return out
