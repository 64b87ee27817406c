"""Forks of an ``n > 1`` request (engine/scheduler/forks.py) at the scheduler level: the children share the
leader's full prompt blocks, get a private copy of the partial last block and a state slot, and
every block and slot comes back after finishing, aborting, preempting or falling back; and the
runner's whole-block copy against a block-by-block reference."""

from dataclasses import dataclass

import pytest
import torch

from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.kv_cache.state_slots import StateSlots
from kimitui.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from kimitui.engine.sequence import Sequence, SequenceStatus

BS = 4


@dataclass
class Params:
    max_tokens: int | None = 3
    min_tokens: int = 0
    ignore_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()


def make(num_blocks=64, max_num_seqs=8, budget=64, hybrid=False, prefix=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64, block_size=BS)
    slots = StateSlots(max_num_seqs, 4) if hybrid else None
    return Scheduler(config, BlockManager(num_blocks, BS, prefix, slots))


def family(n_prompt, n=4, max_tokens=3):
    prompt = list(range(10, 10 + n_prompt))
    return [Sequence(f"r#{i}", prompt, Params(max_tokens=max_tokens)) for i in range(n)]


def step(sched, tokens=None):
    out = sched.schedule()
    sampled = [(tokens or {}).get(i.seq.seq_id, 7) if i.do_sample else None for i in out.scheduled]
    return out, sched.postprocess(out, sampled)


def drain(sched):
    for _ in range(100):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("did not finish")


def check_empty(sched, free_at_start):
    bm = sched.block_manager
    assert bm.num_free_blocks == free_at_start
    assert all(b.ref_count == 0 for b in bm.blocks)
    if sched.state_slots is not None:
        sched.state_slots.check_consistent()
        assert sched.state_slots.num_free_seq_slots == sched.state_slots.max_num_seqs
    assert not sched.forks


@pytest.mark.parametrize("hybrid", [False, True])
def test_children_fork_in_the_leaders_first_sampling_step(hybrid):
    sched = make(hybrid=hybrid)
    lead, *kids = family(10)  # 2 full blocks + 2 tokens
    sched.add(lead)
    sched.add_forks(lead, kids)
    out, _ = step(sched)
    if hybrid:  # the prefill is cut at the prompt's last full block for its state snapshot
        assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [("r#0", 8)]
        out, _ = step(sched)
    # the rest of the prompt, then three forks that compute nothing
    assert [(i.seq.seq_id, i.num_new_tokens, i.fork_of) for i in out.scheduled] == [
        ("r#0", 2 if hybrid else 10, None),
        ("r#1", 0, "r#0"),
        ("r#2", 0, "r#0"),
        ("r#3", 0, "r#0"),
    ]
    shared = lead.block_table[:2]
    for k in kids:
        assert k.block_table[:2] == shared and k.block_table[2] != lead.block_table[2]
        assert k.num_computed_tokens == 10 and k.num_tokens == 11 and k.status == SequenceStatus.RUNNING
    assert [b.ref_count for b in (sched.block_manager.blocks[i] for i in shared)] == [4, 4]
    assert out.block_copies == [(lead.block_table[2], k.block_table[2]) for k in kids]
    if hybrid:
        assert out.state_forks == [(lead.state_slot, k.state_slot) for k in kids]
        assert len({lead.state_slot, *(k.state_slot for k in kids)}) == 4
    else:
        assert out.state_forks == []
    # next step: four decodes
    out, _ = step(sched)
    assert sorted((i.seq.seq_id, i.num_new_tokens, i.is_prefill) for i in out.scheduled) == [
        (f"r#{i}", 1, False) for i in range(4)
    ]
    drain(sched)
    check_empty(sched, 64)


def test_a_prompt_ending_on_a_block_boundary_is_shared_whole():
    sched = make()
    lead, *kids = family(8)
    sched.add(lead)
    sched.add_forks(lead, kids)
    out, _ = step(sched)
    assert out.block_copies == []
    assert all(k.block_table == lead.block_table[:2] for k in kids)
    drain(sched)
    check_empty(sched, 64)


def test_the_children_register_only_their_own_blocks():
    sched = make()
    lead, *kids = family(6, n=2, max_tokens=6)  # the children fill the copied block with their own tokens
    sched.add(lead)
    sched.add_forks(lead, kids)
    step(sched, {"r#0": 1, "r#1": 2})
    for _ in range(3):
        step(sched)
    bm = sched.block_manager
    # block 1 of each differs (a different first output token); block 0 is the one shared block
    assert lead.block_table[0] == kids[0].block_table[0]
    h0 = bm.block_hash(lead, 0)
    assert bm.is_cached_block(lead.block_table[0], h0)
    assert bm.is_cached_block(lead.block_table[1], bm.block_hash(lead, 1))
    assert bm.is_cached_block(kids[0].block_table[1], bm.block_hash(kids[0], 1))
    drain(sched)
    check_empty(sched, 64)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("when", [0, 1, 3])
def test_abort_at_any_point_returns_every_block_and_slot(hybrid, when):
    sched = make(hybrid=hybrid)
    lead, *kids = family(10, max_tokens=20)
    sched.add(lead)
    sched.add_forks(lead, kids)
    for _ in range(when):
        step(sched)
    for s in (kids[1], lead, kids[0], kids[2]):  # a child, the parent, then the rest
        assert sched.abort(s.seq_id) is s
    assert not sched.has_unfinished()
    check_empty(sched, 64)


def test_aborting_the_leader_before_its_prompt_is_computed_queues_the_children():
    sched = make(budget=8)  # the 10-token prompt takes two steps
    lead, *kids = family(10, n=3)
    sched.add(lead)
    sched.add_forks(lead, kids)
    step(sched)
    sched.abort(lead.seq_id)
    out, _ = step(sched)
    # the children now run on their own, after a hit on the blocks the leader computed
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [("r#1", 2), ("r#2", 2)]
    drain(sched)
    check_empty(sched, 64)


def test_no_room_to_fork_falls_back_to_queueing_with_a_prefix_hit():
    sched = make(max_num_seqs=2)  # the leader plus one fork
    lead, *kids = family(10, n=3)
    sched.add(lead)
    sched.add_forks(lead, kids)
    out, _ = step(sched)
    assert [i.fork_of for i in out.scheduled] == [None, "r#0"]
    assert kids[1].status == SequenceStatus.WAITING and sched.num_waiting == 0
    step(sched)  # the parked child is queued now, but max_num_seqs holds it back
    assert sched.num_waiting == 1
    drain(sched)
    # it ran the ordinary way: a hit on the 2 full blocks, the partial block recomputed
    assert kids[1].num_cached_tokens == 8
    check_empty(sched, 64)


def test_no_free_block_to_fork_falls_back():
    sched = make(num_blocks=16)
    lead, *kids = family(10, n=2, max_tokens=2)
    filler = Sequence("big", list(range(100, 150)), Params(max_tokens=40))  # 13 blocks and growing
    sched.add(filler)
    step(sched)
    sched.add(lead)
    sched.add_forks(lead, kids)
    out, _ = step(sched)  # the leader takes the last 3 blocks: none left for the partial copy
    assert sched.block_manager.num_free_blocks == 0
    assert [i.fork_of for i in out.scheduled if i.seq.seq_id.startswith("r")] == [None]
    drain(sched)
    check_empty(sched, 16)


def test_preempted_child_recomputes_and_frees_everything():
    sched = make(num_blocks=16, max_num_seqs=4)
    lead, *kids = family(10, n=3, max_tokens=30)
    sched.add(lead)
    sched.add_forks(lead, kids)
    drain(sched)  # 3 samples of 40 tokens need 30 blocks: preemptions happen
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 30 for s in [lead, *kids])
    check_empty(sched, 16)


def test_add_forks_checks_its_arguments():
    sched = make()
    lead, *kids = family(10, n=2)
    with pytest.raises(ValueError, match="queued leader"):
        sched.add_forks(lead, kids)
    sched.add(lead)
    other = Sequence("x", [1, 2, 3], Params())
    with pytest.raises(ValueError, match="another prompt"):
        sched.add_forks(lead, [other])
    sched.add_forks(lead, kids)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_forks(lead, kids)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm device")),
    ],
)
def test_copy_blocks_copies_whole_paged_blocks_and_leaves_state_layers(device):
    from kimitui.engine.kv_cache.pool import MLACacheSpec, copy_blocks
    from kimitui.engine.kv_cache.state import KDAStateSpec

    torch.manual_seed(0)
    mla = MLACacheSpec(dim=6, dtype=torch.bfloat16).allocate(8, BS, 2, torch.device(device))
    mla.copy_(torch.randn_like(mla, dtype=torch.float32).to(mla.dtype))
    state = KDAStateSpec(2, 3, 3, 4).allocate(8, BS, 2, torch.device(device))
    state.recurrent.normal_()
    before, rec = mla.clone(), state.recurrent.clone()
    pairs = torch.tensor([[1, 5], [1, 6], [3, 2]], device=device)
    copy_blocks([mla, state], pairs[:, 0], pairs[:, 1])
    want = before.clone()  # an independent reference: one block at a time
    for s, d in [(1, 5), (1, 6), (3, 2)]:
        want[d] = before[s]
    assert torch.equal(mla, want)
    assert torch.equal(state.recurrent, rec)
