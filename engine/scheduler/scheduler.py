"""Continuous batching policy: which sequences run in the next step and with how many tokens.

Pure Python: the scheduler sees sequences and block ids, never tensors. One step =
``schedule()`` -> the runner computes the scheduled tokens -> ``postprocess()``. Requests are
served first come, first served; running decodes go first (one token each), then prefill chunks
share what is left of the token budget, so a long prompt never stalls the decodes beside it.

Hybrid models (KDA layers, ``block_manager.state_slots`` set) also get a state slot per running
sequence, and prefix snapshots of that state. Snapshot policy: a prefill chunk that would cross a
snapshot boundary is cut there, so the state after exactly that many tokens exists at the end of
a step and can be copied out. The boundaries are every ``snapshot_every_blocks`` blocks (so a
shared system prompt is resumable from at most that many blocks before its end) and the prompt's
last full block (the longest hit a repeat of the same prompt can have). A boundary whose block
already has a snapshot cuts nothing, so a warm prefix costs no extra steps; a cold prompt of N
tokens costs at most N / (snapshot_every_blocks * block_size) extra chunk ends (this holds with
chunked prefill off too: a hybrid prompt is still cut at its snapshot boundaries).

Multi-turn reuse: a plain decode whose token completes a block also saves the state (the request's
"tail" snapshot), replacing the same sequence's previous tail snapshot, so a finished request keeps
exactly one snapshot at the last full block of prompt + output: the next turn of a conversation,
whose prompt repeats this one and its reply, resumes there (SGLang's hybrid radix cache keeps the
state at the end of each request likewise). That costs one state copy per ``block_size`` decoded
tokens and at most one snapshot slot per running sequence; tail snapshots are evicted like any
other. A decode verifying draft tokens skips it (how many are accepted is known only after the step).

Forks (``n > 1``): the other samples of a request are parked beside its first sequence and forked
from it in the step where it samples its first token, so the prompt is computed once (engine/scheduler/forks.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.kv_cache.state_slots import StateSlots
from kimitui.engine.scheduler.forks import ParkedForks, can_fork, fork_child
from kimitui.engine.scheduler.output import ScheduledSeq, SchedulerOutput  # noqa: F401 - re-exported: the step plan's types
from kimitui.engine.sequence import FINISH_STATUS, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. ``max_num_batched_tokens`` is the token budget of one step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    # Hybrid models: a prefix snapshot every this many blocks of a prompt (and at its last full block).
    snapshot_every_blocks: int = 32
    # Hybrid models: keep a snapshot at the last full block a request's decodes reach (multi-turn reuse).
    snapshot_request_end: bool = True
    # Speculative decoding with a model drafter: KV slots reserved past the tokens a step computes,
    # which the drafter writes while it chains its guesses (0 for draft-free proposers).
    num_lookahead_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "snapshot_every_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {self.num_lookahead_slots}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token per decode step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix caching and recompute preemption."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if block_manager.block_size != config.block_size:
            raise ValueError(
                f"block_size mismatch: scheduler {config.block_size}, block manager {block_manager.block_size}"
            )
        capacity = block_manager.num_blocks * block_manager.block_size
        if capacity < config.max_model_len:
            # Otherwise a lone sequence could outgrow the cache and preempt itself forever.
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({block_manager.num_blocks} blocks of "
                f"{block_manager.block_size}), fewer than max_model_len={config.max_model_len}; "
                f"lower max_model_len or give the cache more memory"
            )
        self.config = config
        self.block_manager = block_manager
        self.state_slots: StateSlots | None = block_manager.state_slots
        if self.state_slots is not None and self.state_slots.max_num_seqs < config.max_num_seqs:
            raise ValueError(
                f"{self.state_slots.max_num_seqs} state slots for max_num_seqs={config.max_num_seqs}: "
                f"every running sequence of a hybrid model needs one"
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail is preempted first
        self._seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._tails: dict[str, int] = {}  # seq_id -> block hash of its latest tail snapshot
        self.forks = ParkedForks()  # n > 1: samples waiting for their leader's first token

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises ValueError if it can never run."""
        self._check_new(seq)
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def add_forks(self, leader: Sequence, children: list[Sequence]) -> None:
        """Park ``children`` (the same prompt as ``leader``, already added) to be forked from the
        leader when it samples its first token (engine/scheduler/forks.py)."""
        if self._seqs.get(leader.seq_id) is not leader or leader.num_output_tokens:
            raise ValueError(f"forks need a queued leader that has not sampled yet, got {leader!r}")
        for child in children:
            if child.prompt_token_ids != leader.prompt_token_ids:
                raise ValueError(f"fork {child.seq_id!r} has another prompt than its leader {leader.seq_id!r}")
        for child in children:
            self._check_new(child)
            child.status = SequenceStatus.WAITING
            self._seqs[child.seq_id] = child
            self.forks.park(leader.seq_id, child)

    def _check_new(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"request id {seq.seq_id!r} is already in use")
        limit = self.config.max_model_len
        if seq.num_tokens > limit:
            raise ValueError(
                f"request {seq.seq_id!r}: prompt has {seq.num_tokens} tokens, longer than max_model_len={limit}"
            )
        bm = self.block_manager
        if -(-seq.num_tokens // bm.block_size) > bm.num_blocks:
            raise ValueError(
                f"request {seq.seq_id!r}: prompt needs more KV cache blocks than exist "
                f"({bm.num_blocks} blocks of {bm.block_size} tokens)"
            )

    def abort(self, seq_id: str) -> Sequence | None:
        """Stop a request in any state and free its blocks; None if unknown or already finished."""
        return self.finish(seq_id, "abort")

    def finish(self, seq_id: str, reason: str) -> Sequence | None:
        """Finish a live request with ``reason`` ("stop", "length", "abort"), e.g. on a stop string."""
        if reason not in FINISH_STATUS:
            raise ValueError(f"finish reason must be one of {sorted(FINISH_STATUS)}, got {reason!r}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq_id in self.forks:  # parked, never ran
            self.forks.unpark(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick the sequences and token counts for the next step."""
        out = SchedulerOutput()
        self._queue_unforked()
        budget = self.config.max_num_batched_tokens
        # Running sequences in admission order, so block shortages preempt the latest admitted
        # (the tail) and never an earlier one; each decode's token is set aside from the budget
        # first, prefill chunks share the rest. Emitted decodes-first for the runner.
        prefill_budget = budget - sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            is_decode = seq.num_uncomputed_tokens == 1
            drafts: list[int] = []
            if is_decode:
                # Draft tokens are budgeted like any others, before the prefill chunks (as vLLM's
                # running requests come first); what does not fit is dropped, never carried over.
                drafts = seq.spec_token_ids[: max(0, min(prefill_budget, seq.spec_budget(self.config.max_model_len)))]
                seq.spec_token_ids = []
            num_new = 1 + len(drafts) if is_decode else min(seq.num_uncomputed_tokens, prefill_budget)
            if num_new == 0:
                continue
            snap = None if is_decode else self._snapshot_boundary(seq, num_new)
            if snap is not None:
                num_new = snap - seq.num_computed_tokens
            if not self._reserve(seq, num_new + self._lookahead(seq, num_new), out.preempted):
                continue
            prefill_budget -= num_new - (1 if is_decode else 0)
            if snap is not None:
                self._plan_save(seq, snap, out)
            elif is_decode and not drafts and self._tail_due(seq):
                self._plan_save(seq, seq.num_computed_tokens + 1, out, tail=True)
            (decodes if is_decode else prefills).append(self._scheduled(seq, num_new, drafts))
        budget -= sum(item.num_new_tokens for item in decodes + prefills)

        # Admit waiting sequences; never right after a preemption (they would fight for blocks).
        bm = self.block_manager
        admitted: list[ScheduledSeq] = []
        while self.waiting and not out.preempted and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            remaining = seq.num_tokens - bm.match_prefix(seq)
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq, num_new):
                break  # FCFS: later requests wait behind this one
            self.waiting.popleft()
            bm.allocate(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)  # same hit as can_allocate saw
            snap = self._snapshot_boundary(seq, num_new)
            if snap is not None:
                num_new = snap - seq.num_computed_tokens
            if not bm.append_slots(seq, num_new):
                raise RuntimeError(f"block manager refused {seq.seq_id!r} after can_allocate")
            bm.append_slots(seq, num_new + self._lookahead(seq, num_new))  # best effort, beyond the step
            if self.state_slots is not None:
                self._give_state_slot(seq, out)
                if snap is not None:
                    self._plan_save(seq, snap, out)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= num_new
            admitted.append(self._scheduled(seq, num_new))

        # An admitted sequence with a single uncomputed token (1-token prompt, or a prefix hit up
        # to its last token) is a decode for the runner: keep the decodes-first order.
        out.scheduled = decodes + [i for i in admitted if not i.is_prefill] + prefills
        out.scheduled += [i for i in admitted if i.is_prefill]
        if self.forks:
            for item in list(out.scheduled):
                if (
                    self.forks.leads(item.seq.seq_id)
                    and item.do_sample
                    and not item.spec_token_ids
                    and item.seq.num_output_tokens == 0
                ):
                    self._fork(item.seq, out)

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def postprocess(self, output: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that finished (their blocks are freed).

        ``sampled_token_ids[i]`` belongs to ``output.scheduled[i]``; None for a prefill chunk that
        did not reach the end of its sequence.
        """
        if len(sampled_token_ids) != len(output.scheduled):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(output.scheduled)} scheduled sequences")
        finished = []
        for item, token_id in zip(output.scheduled, sampled_token_ids):
            seq = item.seq
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted or finished while the step ran
            if isinstance(token_id, list):
                reason = self._apply_verified(item, token_id)
                if reason is not None:
                    self.running.remove(seq)
                    self._finish(seq, reason)
                    finished.append(seq)
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_computed(seq)
            if token_id is None:
                if item.do_sample:
                    raise ValueError(f"{seq.seq_id!r} reached the end of its tokens but got no sample")
                continue
            seq.append_token(token_id)
            reason = self._check_stop(seq)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        self._commit_saves(output)
        return finished

    def _apply_verified(self, item: ScheduledSeq, tokens: list[int]) -> str | None:
        """A decode that verified drafts: ``tokens`` = the accepted drafts, then one sampled token.

        The verified token and the accepted drafts now have their KV; the rejected positions'
        cache slots hold stale values past ``num_computed_tokens``, which the next steps overwrite
        before any attention reads them, and only blocks of computed tokens are ever hashed. Tokens
        after a stop condition are dropped, as if they had been produced one step at a time.
        Returns the finish reason, or None."""
        seq = item.seq
        if not tokens or len(tokens) > len(item.spec_token_ids) + 1:
            raise ValueError(f"{seq.seq_id!r}: {len(tokens)} tokens back for {len(item.spec_token_ids)} drafts")
        for t in tokens[:-1]:
            seq.append_token(t)
            reason = self._check_stop(seq)
            if reason is not None:
                return reason
        seq.num_computed_tokens += len(tokens)  # the verified token + the accepted drafts
        self.block_manager.register_computed(seq)
        seq.append_token(tokens[-1])
        return self._check_stop(seq)

    # -- forks (engine/scheduler/forks.py) --------------------------------------------------------------

    def _fork(self, leader: Sequence, out: SchedulerOutput) -> None:
        """Fork the parked children of ``leader``, whose step samples its first token; the ones that
        do not fit stay parked and are queued next step (engine/scheduler/forks.py)."""
        for child in self.forks.children(leader.seq_id):
            if len(self.running) >= self.config.max_num_seqs:
                break
            if not can_fork(leader, child, self.block_manager, self.state_slots):
                continue
            self.forks.unpark(child)
            block_copy, state_copy = fork_child(leader, child, self.block_manager, self.state_slots)
            if block_copy is not None:
                out.block_copies.append(block_copy)
            if state_copy is not None:
                out.state_forks.append(state_copy)
            self.running.append(child)
            out.scheduled.append(ScheduledSeq(child, 0, False, start=child.num_computed_tokens, fork_of=leader.seq_id))

    def _queue_unforked(self) -> None:
        """Queue the parked children whose leader has sampled: they could not fork in that step."""
        for lid in self.forks.leaders():
            if self._seqs[lid].num_output_tokens > 0:
                self.waiting.extend(self.forks.release(lid))

    # -- internals -------------------------------------------------------------------------

    def _scheduled(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(
            seq=seq,
            num_new_tokens=num_new,
            is_prefill=seq.num_uncomputed_tokens > 1,
            start=start,
            do_sample=start + num_new - len(drafts) == seq.num_tokens,
            spec_token_ids=tuple(drafts),
        )

    def _lookahead(self, seq: Sequence, num_new: int) -> int:
        """Extra KV slots a model drafter writes after a step that ends ``seq`` (0 otherwise)."""
        end = seq.num_computed_tokens + num_new
        if not self.config.num_lookahead_slots or end < seq.num_tokens:
            return 0
        return max(0, min(self.config.num_lookahead_slots, self.config.max_model_len - end))

    # -- hybrid state slots and snapshots ---------------------------------------------------

    def _give_state_slot(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Admission: a fresh slot, restored from the snapshot at the end of the prefix hit if any.

        With no hit the slot is left as it is: a row at position 0 starts from a zero state (the
        runner zeroes it), so the previous owner's state never leaks in.
        """
        seq.state_slot = self.state_slots.allocate(seq.seq_id)
        if seq.num_cached_tokens:
            bm = self.block_manager
            last = seq.num_cached_tokens // bm.block_size - 1
            src = self.state_slots.touch(bm.block_hash(seq, last))  # _match guaranteed it exists
            out.state_restores.append((src, seq.state_slot))

    def _snapshot_boundary(self, seq: Sequence, num_new: int) -> int | None:
        """The first boundary in ``(computed, computed + num_new]`` worth a snapshot, or None."""
        slots, bm = self.state_slots, self.block_manager
        if slots is None or slots.num_snapshots == 0 or not bm.enable_prefix_caching:
            return None
        bs = bm.block_size
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        last = (seq.num_tokens - 1) // bs * bs  # the longest prefix hit possible (see _match)
        step = self.config.snapshot_every_blocks * bs
        b = (start // step + 1) * step
        candidates = list(range(b, min(end, last) + 1, step))
        if start < last <= end and (not candidates or candidates[-1] != last):
            candidates.append(last)
        for b in candidates:
            if not slots.has_snapshot(bm.block_hash(seq, b // bs - 1)):
                return b
        return None

    def _tail_due(self, seq: Sequence) -> bool:
        """Whether this decode's token completes a block that has no snapshot yet (module doc)."""
        slots, bm = self.state_slots, self.block_manager
        if (
            slots is None
            or slots.num_snapshots == 0
            or not bm.enable_prefix_caching
            or not self.config.snapshot_request_end
        ):
            return False
        end = seq.num_computed_tokens + 1
        return end % bm.block_size == 0 and not slots.has_snapshot(bm.block_hash(seq, end // bm.block_size - 1))

    def _plan_save(self, seq: Sequence, boundary: int, out: SchedulerOutput, tail: bool = False) -> None:
        snap = self.state_slots.reserve_snapshot()
        if snap is None:
            return  # every snapshot slot is being written this step; the chunk is just shorter
        i = boundary // self.block_manager.block_size - 1
        out.state_saves.append((seq.state_slot, snap))
        out.save_blocks.append((seq.block_table[i], self.block_manager.block_hash(seq, i)))
        out.save_tails.append(seq.seq_id if tail else None)

    def _commit_saves(self, out: SchedulerOutput) -> None:
        """Key each snapshot written by the step under its block's hash if that block is now the
        cached one for the hash (it may not be: the sequence left mid-step, or another sequence
        registered the same prefix first). A sequence's new tail snapshot replaces its previous one."""
        tails = out.save_tails or [None] * len(out.state_saves)
        for (_, snap), (bid, h), tail in zip(out.state_saves, out.save_blocks, tails):
            if not self.block_manager.is_cached_block(bid, h):
                self.state_slots.cancel_snapshot(snap)
                continue
            if self.state_slots.commit_snapshot(snap, h) and tail is not None:
                old = self._tails.get(tail)
                if old is not None and old != h:
                    self.state_slots.drop_snapshot(old)  # the block stays cached, without a state
                self._tails[tail] = h
        # a finished sequence's last tail snapshot stays, as any other snapshot
        for sid in [sid for sid in self._tails if sid not in self._seqs]:
            del self._tails[sid]

    def _free_state_slot(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.state_slots.free(seq.state_slot, seq.seq_id)
            seq.state_slot = None

    def _reserve(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
        """Get blocks for ``seq``, preempting the most recently admitted sequences if needed.

        Returns False when ``seq`` itself had to be preempted.
        """
        while not self.block_manager.append_slots(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: the KV is dropped and rebuilt later from prompt + output so far,
        # which the prefix cache often makes cheap (freed blocks stay findable until reused).
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._free_state_slot(seq)  # restarts from a zero state or a snapshot when re-admitted
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = FINISH_STATUS[reason]
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self._free_state_slot(seq)
        del self._seqs[seq.seq_id]
        # a leader that leaves before forking all its children: they run on their own
        self.waiting.extend(self.forks.release(seq.seq_id))

    def _check_stop(self, seq: Sequence) -> str | None:
        params = seq.sampling_params
        num_out = seq.num_output_tokens
        max_tokens = getattr(params, "max_tokens", None)
        # As vLLM: before min_tokens neither eos nor stop_token_ids end the request.
        if num_out >= (getattr(params, "min_tokens", 0) or 0):
            last = seq.output_token_ids[-1]
            if not getattr(params, "ignore_eos", False) and last in seq.eos_token_ids:
                return "stop"
            if last in (getattr(params, "stop_token_ids", None) or ()):
                return "stop"
        if max_tokens is not None and num_out >= max_tokens:
            return "length"
        if seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None
