"""State slots and prefix snapshots of the hybrid (KDA) cache, at the scheduler level (no tensors)."""

from dataclasses import dataclass

import pytest

from kimitui.engine.kv_cache.block_manager import BlockManager, hash_block
from kimitui.engine.kv_cache.state_slots import StateSlots
from kimitui.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from kimitui.engine.sequence import Sequence, SequenceStatus

BS = 4
SEQS = 4
SNAPS = 3


@dataclass
class Params:
    max_tokens: int | None = 2
    min_tokens: int = 0
    ignore_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()


def make(num_blocks=64, budget=64, snaps=SNAPS, every=2, prefix=True, max_model_len=128):
    config = SchedulerConfig(
        max_num_seqs=SEQS,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=BS,
        snapshot_every_blocks=every,
    )
    slots = StateSlots(SEQS, snaps)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix, slots)), slots


def seq(seq_id, tokens, max_tokens=2):
    return Sequence(seq_id, list(tokens), Params(max_tokens=max_tokens))


def step(sched, token=7):
    out = sched.schedule()
    return out, sched.postprocess(out, [token if i.do_sample else None for i in out.scheduled])


def drain(sched):
    for _ in range(200):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("did not finish")


# -- the allocator ------------------------------------------------------------------------------


def test_slot_allocator_catches_double_free_and_wrong_owner():
    slots = StateSlots(2, 1)
    a, b = slots.allocate("a"), slots.allocate("b")
    assert {a, b} == {0, 1} and slots.num_slots == 3
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.allocate("c")
    slots.free(a, "a")
    with pytest.raises(RuntimeError, match="double free"):
        slots.free(a, "a")
    with pytest.raises(RuntimeError, match="held by 'b'"):
        slots.free(b, "a")
    slots.check_consistent()
    slots._free_seq.append(b)  # a slot both free and held
    with pytest.raises(AssertionError, match="sequence state slots inconsistent"):
        slots.check_consistent()


def test_snapshots_are_lru_and_dropped_with_their_block():
    slots = StateSlots(1, 2)
    s1 = slots.reserve_snapshot()
    s2 = slots.reserve_snapshot()
    assert {s1, s2} == {1, 2}
    assert slots.reserve_snapshot() is None  # both being written this step
    assert slots.commit_snapshot(s1, 111) and slots.commit_snapshot(s2, 222)
    slots.touch(111)  # 222 is now the least recently used
    s3 = slots.reserve_snapshot()
    assert s3 == s2 and not slots.has_snapshot(222) and slots.snapshot_of(111) == s1
    assert not slots.commit_snapshot(s3, 111)  # already kept: the new copy is given back
    slots.drop_snapshot(111)
    assert slots.num_free_snapshot_slots == 2 and slots.num_snapshots_held == 0
    slots.check_consistent()


# -- the scheduler ------------------------------------------------------------------------------


def test_prefill_is_cut_at_snapshot_boundaries_and_saved():
    sched, slots = make()
    a = seq("a", range(1, 21))  # 20 tokens: boundaries at 8 (every 2 blocks) and 16 (interval and last full block)
    sched.add(a)
    out, _ = step(sched)
    assert a.state_slot == 0 and out.scheduled[0].num_new_tokens == 8
    assert out.state_restores == [] and out.state_saves == [(0, SEQS + 0)]
    out, _ = step(sched)
    assert (out.scheduled[0].start, out.scheduled[0].end) == (8, 16) and out.state_saves == [(0, SEQS + 1)]
    out, _ = step(sched)
    assert (out.scheduled[0].start, out.scheduled[0].end) == (16, 20) and out.state_saves == []
    assert slots.num_snapshots_held == 2
    drain(sched)
    assert a.state_slot is None and slots.num_free_seq_slots == SEQS
    slots.check_consistent()


def test_last_full_block_of_the_prompt_gets_a_snapshot():
    sched, slots = make(every=100)
    a = seq("a", range(1, 15))  # 14 tokens: the longest possible hit is 12
    sched.add(a)
    out, _ = step(sched)
    assert out.scheduled[0].num_new_tokens == 12 and out.state_saves == [(0, SEQS)]


def test_repeat_and_shared_prefix_resume_from_snapshots():
    sched, slots = make()
    sched.add(seq("a", range(1, 21)))
    drain(sched)
    same = seq("same", range(1, 21))
    sched.add(same)
    out, _ = step(sched)
    assert same.num_cached_tokens == 16
    assert out.state_restores == [(slots.snapshot_of(sched.block_manager.block_hash(same, 3)), same.state_slot)]
    assert (out.scheduled[0].start, out.scheduled[0].end) == (16, 20) and out.state_saves == []
    drain(sched)
    # Shares 14 tokens: the MLA blocks hit 12 tokens, but the last snapshot within them is at 8.
    other = seq("other", list(range(1, 15)) + [99] * 6)
    sched.add(other)
    out, _ = step(sched)
    assert other.num_cached_tokens == 8 and len(out.state_restores) == 1
    assert sched.block_manager.num_prefix_hit_tokens == 16 + 8


def test_without_snapshot_slots_a_hybrid_model_gets_no_prefix_hits():
    sched, slots = make(snaps=0)
    a = seq("a", range(1, 21))
    sched.add(a)
    out, _ = step(sched)
    assert out.scheduled[0].num_new_tokens == 20 and out.state_saves == []  # nothing cut
    drain(sched)
    b = seq("b", range(1, 21))
    sched.add(b)
    step(sched)
    assert b.num_cached_tokens == 0


def test_evicted_block_takes_its_snapshot_along():
    sched, slots = make(num_blocks=8, max_model_len=32, every=100)  # snapshots at last full blocks only
    sched.add(seq("a", range(1, 10)))  # snapshot at 8 (block 1)
    drain(sched)
    a_key = hash_block(hash_block(None, (1, 2, 3, 4)), (5, 6, 7, 8))
    assert slots.has_snapshot(a_key) and slots.num_snapshots_held == 1
    sched.add(seq("big", range(100, 130), max_tokens=1))  # 30 tokens: needs every block, evicts a's
    drain(sched)
    # A free snapshot slot was left, so a's snapshot went with its block, not by snapshot LRU.
    assert not slots.has_snapshot(a_key) and slots.num_snapshots_held == 1  # big's, at 28
    again = seq("again", range(1, 10))
    sched.add(again)
    step(sched)
    assert again.num_cached_tokens == 0
    slots.check_consistent()


def test_abort_finish_and_preemption_free_slots():
    sched, slots = make(num_blocks=8, budget=16, snaps=1, max_model_len=32)
    seqs = [seq(f"s{i}", range(10 * i + 1, 10 * i + 9), max_tokens=12) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step(sched)
    held = {s.seq_id: s.state_slot for s in seqs if s.state_slot is not None}
    assert len(set(held.values())) == len(held) >= 2  # distinct slots
    sched.abort(seqs[0].seq_id)
    assert seqs[0].state_slot is None and seqs[0].status == SequenceStatus.FINISHED_ABORTED
    preempted = False
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        preempted |= bool(out.preempted)
        for p in out.preempted:
            assert p.state_slot is None
        running = [s.state_slot for s in sched.running]
        assert None not in running and len(set(running)) == len(running)
        assert slots.num_free_seq_slots == SEQS - len(running)
    assert preempted and not sched.has_unfinished()
    assert slots.num_free_seq_slots == SEQS and sched.block_manager.num_free_blocks == 8
    slots.check_consistent()


def test_abort_while_waiting_and_saves_of_a_sequence_that_left_mid_step():
    sched, slots = make()
    a, b = seq("a", range(1, 21)), seq("b", range(50, 60))
    sched.add(a)
    out = sched.schedule()
    assert out.state_saves  # a snapshot is being written for a
    sched.add(b)
    sched.abort("b")  # never scheduled: nothing to free but its queue entry
    sched.abort("a")  # left while the step ran: its snapshot must not be kept
    sched.postprocess(out, [None])
    assert slots.num_snapshots_held == 0 and slots.num_free_seq_slots == SEQS
    slots.check_consistent()


def test_same_prefix_computed_twice_in_one_step_keeps_one_snapshot():
    sched, slots = make()
    a, b = seq("a", range(1, 13)), seq("b", range(1, 13))
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert len(out.state_saves) == 2  # neither was cached when the step was planned
    assert slots.num_snapshots_held == 1
    slots.check_consistent()


def test_non_hybrid_block_manager_hands_out_no_slots():
    config = SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=64, max_model_len=128, block_size=BS)
    sched = Scheduler(config, BlockManager(64, BS))
    a = seq("a", range(1, 21))
    sched.add(a)
    out, _ = step(sched)
    assert a.state_slot is None and out.scheduled[0].num_new_tokens == 20
    assert out.state_saves == [] and out.state_restores == []


def test_too_few_state_slots_for_max_num_seqs():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=BS)
    with pytest.raises(ValueError, match="state slots for max_num_seqs=8"):
        Scheduler(config, BlockManager(64, BS, True, StateSlots(4, 0)))
