"""What one scheduler step hands the runner: each sequence's share of the step (``ScheduledSeq``)
and the whole plan (``SchedulerOutput``), with the cache and state copies to make around it.
``engine.scheduler`` decides them (its module doc explains forks and state snapshots)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kimitui.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)`` are computed.

    ``is_prefill``: more than one token was uncomputed, i.e. prompt (or, after preemption,
    prompt + earlier output) being caught up on; a decode computes exactly its last sampled token.
    ``do_sample``: the chunk reaches the end of the sequence, so the runner samples a token;
    otherwise the runner returns None for it.
    ``spec_token_ids``: a decode's draft tokens (speculative decoding), verified in the same step:
    ``num_new_tokens`` = 1 + their number, one row each after the last sampled token.
    """

    seq: Sequence
    num_new_tokens: int
    is_prefill: bool
    start: int = 0
    do_sample: bool = True
    spec_token_ids: tuple[int, ...] = ()
    # A forked child (module doc): computes nothing, samples from this leader's last row.
    fork_of: str | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """A step's plan: ``scheduled`` decodes first, then prefills; ``preempted`` were moved back to
    the waiting queue (blocks freed) while planning it; ``num_batched_tokens`` is the step's size."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Hybrid models, state slot copies for the runner: (snapshot slot, sequence slot) before the
    # step (a prefix hit resumes from its snapshot), (sequence slot, snapshot slot) after it.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Per save: (block id, block hash); postprocess keys the snapshot once the block is cached.
    save_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Per save: the sequence id for a decode's tail snapshot (replaces its previous one), else None.
    save_tails: list[str | None] = field(default_factory=list)
    # Forks (module doc), applied by the runner after the forward pass: (leader's block, child's
    # block) whole-block KV copies, and (leader's slot, child's slot) state copies on hybrid models.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_forks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
