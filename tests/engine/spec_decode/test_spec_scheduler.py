"""The scheduler's side of speculative decoding, without tensors: drafts are budgeted like other
tokens and never reach past max_tokens or max_model_len; a verified decode's accepted tokens are
applied one at a time (stops cut the rest); only accepted tokens' blocks are hashed; lookahead
slots are reserved for model drafters."""

from dataclasses import dataclass

from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from kimitui.engine.sequence import Sequence

BS = 4
EOS = 0


@dataclass
class Params:
    max_tokens: int | None = 32
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def make(budget=64, max_model_len=64, lookahead=0, num_blocks=64):
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=BS,
        num_lookahead_slots=lookahead,
    )
    return Scheduler(cfg, BlockManager(num_blocks, BS, enable_prefix_caching=True))


def decoding(sched, sid="a", prompt=(1, 2, 3, 4, 5), **params):
    """A sequence past its prefill, decoding (one sampled token, uncomputed)."""
    s = Sequence(sid, list(prompt), Params(**params), eos_token_ids=(EOS,))
    sched.add(s)
    out = sched.schedule()
    sched.postprocess(out, [9 if i.do_sample else None for i in out.scheduled])
    assert s.num_uncomputed_tokens == 1
    return s


def test_drafts_become_extra_tokens_of_the_decode():
    sched = make()
    s = decoding(sched)
    s.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.spec_token_ids == (11, 12, 13) and item.num_new_tokens == 4 and not item.is_prefill
    assert item.do_sample and out.num_batched_tokens == 4
    assert s.spec_token_ids == []  # consumed: a proposer drafts anew after every step
    assert len(s.block_table) * BS >= s.num_computed_tokens + 4


def test_accepted_tokens_apply_and_the_computed_length_counts_only_them():
    sched = make()
    s = decoding(sched)  # prompt 5 + sampled 9: 5 computed
    s.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    sched.postprocess(out, [[11, 12, 40]])  # two accepted, then 40 sampled at the rejection
    assert s.output_token_ids == [9, 11, 12, 40]
    assert s.num_computed_tokens == 5 + 3 and s.num_uncomputed_tokens == 1
    # blocks hashed only as far as accepted tokens reach: 8 computed = 2 full blocks
    assert sched.block_manager.num_cached_blocks == 2


def test_a_stop_inside_the_accepted_drafts_drops_the_rest():
    sched = make()
    s = decoding(sched, stop_token_ids=(12,))
    s.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    finished = sched.postprocess(out, [[11, 12, 13, 50]])
    assert finished == [s] and s.finish_reason == "stop" and s.output_token_ids == [9, 11, 12]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_drafts_never_pass_max_tokens_or_the_context_limit():
    sched = make()
    s = decoding(sched, max_tokens=3)  # 1 output so far: at most 2 more tokens, so 1 draft
    s.spec_token_ids = [11, 12, 13]
    (item,) = sched.schedule().scheduled
    assert item.spec_token_ids == (11,)
    sched2 = make(max_model_len=8)
    s2 = decoding(sched2, prompt=(1, 2, 3, 4, 5, 6))  # 7 tokens of 8: one more token fits, no draft
    s2.spec_token_ids = [11, 12]
    (item,) = sched2.schedule().scheduled
    assert item.spec_token_ids == () and item.num_new_tokens == 1


def test_drafts_share_the_step_budget_with_prefill_chunks():
    sched = make(budget=6)
    a = decoding(sched, "a")
    a.spec_token_ids = [11, 12, 13, 14]
    sched.add(Sequence("b", list(range(1, 30)), Params(), eos_token_ids=(EOS,)))
    out = sched.schedule()
    by_id = {i.seq.seq_id: i for i in out.scheduled}
    assert by_id["a"].num_new_tokens == 5 and by_id["b"].num_new_tokens == 1
    assert out.num_batched_tokens == 6


def test_lookahead_slots_are_reserved_past_the_step():
    sched = make(lookahead=4)
    s = decoding(sched)
    s.spec_token_ids = [11, 12]
    sched.schedule()
    # 5 computed + 3 rows this step + 4 lookahead slots
    assert len(s.block_table) * BS >= 5 + 3 + 4


def test_preemption_drops_drafts():
    sched = make(num_blocks=4, max_model_len=16)
    a = decoding(sched, "a", prompt=tuple(range(1, 8)))
    b = decoding(sched, "b", prompt=tuple(range(1, 8)))
    a.spec_token_ids, b.spec_token_ids = [11, 12, 13], [11, 12, 13]
    out = sched.schedule()
    assert out.preempted and all(not p.spec_token_ids for p in out.preempted)
