"""Forks: the samples of an ``n > 1`` request started from the one sequence that computed the prompt.

Pure Python, used by the scheduler (engine/sampling/fanout.py says what a request's samples are).
``Scheduler.add_forks`` parks the other samples of a request beside its first sequence, the leader.
In the step where the leader samples its first token the scheduler forks each parked child from it
(``fork_child``): the child shares the leader's full prompt blocks (one more reference each: they
never change again), gets a fresh block for the partial last one, whose rows the runner copies in
every paged layer after the forward pass (``SchedulerOutput.block_copies``), and, on a hybrid model,
a state slot the leader's KDA recurrent and short-conv state at the prompt's end is copied into
(``SchedulerOutput.state_forks``). The child's ``ScheduledSeq`` (``fork_of``, no tokens of its own)
samples its first token from a copy of the leader's last logits row, with the child's own seed,
grammar and penalties; from then on it decodes as any sequence. So the prompt is computed once, to
the token.

A child that cannot fork in that step (no free block, no state slot, no ``max_num_seqs`` room, or it
wants every prompt row's log-probs of its own) stays parked and is queued from the next step on:
it takes the ordinary path, a prefix hit on the prompt's full blocks (on a hybrid model resumed from
the snapshot at the last full block) and a recompute of the partial block. So does a child whose
leader left before computing the prompt, and a preempted child (its blocks and slot are freed as any
sequence's). Block accounting stays plain reference counting: every path frees what it holds.
"""

from __future__ import annotations

from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.kv_cache.state_slots import StateSlots
from kimitui.engine.sequence import Sequence, SequenceStatus


class ParkedForks:
    """Children waiting for their leader's first sampling step, by leader id."""

    def __init__(self) -> None:
        self._groups: dict[str, list[Sequence]] = {}  # leader seq_id -> children not forked yet
        self._leader_of: dict[str, str] = {}  # parked child seq_id -> its leader's seq_id

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __contains__(self, seq_id: str) -> bool:
        """Whether ``seq_id`` is a parked child."""
        return seq_id in self._leader_of

    def leads(self, seq_id: str) -> bool:
        """Whether ``seq_id`` is a leader with parked children."""
        return seq_id in self._groups

    def leaders(self) -> list[str]:
        return list(self._groups)

    def children(self, leader_id: str) -> list[Sequence]:
        return list(self._groups.get(leader_id, ()))

    def park(self, leader_id: str, child: Sequence) -> None:
        self._leader_of[child.seq_id] = leader_id
        self._groups.setdefault(leader_id, []).append(child)

    def unpark(self, child: Sequence) -> None:
        """``child`` is forked or aborted: no longer parked."""
        leader_id = self._leader_of.pop(child.seq_id)
        group = self._groups[leader_id]
        group.remove(child)
        if not group:
            del self._groups[leader_id]

    def release(self, leader_id: str) -> list[Sequence]:
        """Unpark every child of ``leader_id`` (to be queued as ordinary sequences)."""
        group = self._groups.pop(leader_id, [])
        for child in group:
            del self._leader_of[child.seq_id]
        return group


def can_fork(leader: Sequence, child: Sequence, bm: BlockManager, slots: StateSlots | None) -> bool:
    """Whether ``child`` can be forked from ``leader`` now (``max_num_seqs`` is the caller's check)."""
    if getattr(child.sampling_params, "logprob_rows", False):
        return False  # wants every prompt row of its own: computed the ordinary way
    if slots is not None and (leader.state_slot is None or not slots.num_free_seq_slots):
        return False
    return bm.can_fork(leader.num_tokens)


def fork_child(
    leader: Sequence, child: Sequence, bm: BlockManager, slots: StateSlots | None
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """Give ``child`` the leader's prompt (module doc); returns the (source, destination) block copy
    and state slot copy the runner must make after the step's forward pass (None where none)."""
    n = leader.num_tokens
    block_copy = bm.fork(leader, child, n)
    state_copy = None
    if slots is not None:
        child.state_slot = slots.allocate(child.seq_id)
        state_copy = (leader.state_slot, child.state_slot)
    child.num_computed_tokens, child.num_cached_tokens = n, 0
    child.status = SequenceStatus.RUNNING
    return block_copy, state_copy
