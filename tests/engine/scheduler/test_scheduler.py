import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kimitui.engine.kv_cache.block_manager import BlockManager
from kimitui.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from kimitui.engine.sequence import Sequence, SequenceStatus

EOS = 0
BS = 4


@dataclass
class Params:
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def make(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=128, chunked=True, prefix=True):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=BS,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, BlockManager(num_blocks, BS, enable_prefix_caching=prefix))


def seq(seq_id, n_prompt, first=1, **params):
    return Sequence(seq_id, list(range(first, first + n_prompt)), Params(**params), eos_token_ids=(EOS,))


def step(sched, token=7):
    out = sched.schedule()
    sampled = [token if item.do_sample else None for item in out.scheduled]
    return out, sched.postprocess(out, sampled)


def run_to_completion(sched, max_steps=1000, token=7):
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        finished += step(sched, token)[1]
    raise AssertionError("did not finish")


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        SchedulerConfig(0, 8, 8, 4)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        SchedulerConfig(16, 8, 64, 4)
    with pytest.raises(ValueError, match="without chunked prefill"):
        SchedulerConfig(4, 32, 64, 4, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="fewer than max_model_len=128"):
        make(num_blocks=8)
    with pytest.raises(ValueError, match="block_size mismatch"):
        Scheduler(SchedulerConfig(4, 32, 16, 4), BlockManager(8, 8))


def test_add_rejects_what_can_never_run():
    sched = make(max_model_len=32, num_blocks=8)
    with pytest.raises(ValueError, match="longer than max_model_len=32"):
        sched.add(seq("a", 33))
    sched.add(seq("b", 32))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(seq("b", 3))


def test_prefill_then_decode_until_max_tokens():
    sched = make()
    sched.add(seq("a", 10, max_tokens=3))
    out, fin = step(sched)
    item = out.scheduled[0]
    assert (item.num_new_tokens, item.is_prefill, item.start, item.do_sample) == (10, True, 0, True)
    assert not fin
    out, fin = step(sched)
    assert [(i.num_new_tokens, i.is_prefill, i.start) for i in out.scheduled] == [(1, False, 10)]
    out, fin = step(sched)
    assert [s.seq_id for s in fin] == ["a"]
    a = fin[0]
    assert a.output_token_ids == [7, 7, 7]
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 64
    assert not sched.has_unfinished()


def test_stop_conditions():
    sched = make(max_model_len=16, num_blocks=8)
    sched.add(seq("eos", 3))
    sched.add(seq("ignore", 3, ignore_eos=True, max_tokens=2))
    sched.add(seq("min", 3, min_tokens=2))
    sched.add(seq("stop_id", 3, stop_token_ids=(5,), ignore_eos=True))
    sched.add(seq("model_len", 14, max_tokens=None, ignore_eos=True))
    out, fin = step(sched, token=EOS)
    assert {s.seq_id: s.finish_reason for s in fin} == {"eos": "stop"}
    out, fin = step(sched, token=EOS)
    reasons = {s.seq_id: s.finish_reason for s in fin}
    assert reasons == {"ignore": "length", "min": "stop", "model_len": "length"}
    out, fin = step(sched, token=5)
    assert {s.seq_id: s.finish_reason for s in fin} == {"stop_id": "stop"}
    assert fin[0].status == SequenceStatus.FINISHED_STOPPED


def test_decodes_are_scheduled_before_prefills():
    sched = make()
    sched.add(seq("a", 5))
    step(sched)
    sched.add(seq("b", 6, first=100))
    out, _ = step(sched)
    assert [(i.seq.seq_id, i.is_prefill) for i in out.scheduled] == [("a", False), ("b", True)]
    out, _ = step(sched)
    assert [i.is_prefill for i in out.scheduled] == [False, False]


def test_chunked_prefill_respects_the_token_budget():
    sched = make(budget=16)
    sched.add(seq("a", 3))
    step(sched)  # a decodes from now on, taking 1 token of each step's budget
    sched.add(seq("long", 40, first=100))
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        assert out.num_batched_tokens <= 16
        assert out.scheduled[0].seq.seq_id == "a"
        item = out.scheduled[1]
        chunks.append((item.start, item.num_new_tokens, item.do_sample))
    assert chunks == [(0, 15, False), (15, 15, False), (30, 10, True)]
    assert sched.get("long").output_token_ids == [7]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched = make(budget=128, chunked=False, max_num_seqs=8)
    for i in range(4):
        sched.add(seq(f"s{i}", 40, first=100 * i))
    out, _ = step(sched)
    assert [i.num_new_tokens for i in out.scheduled] == [40, 40, 40]  # the 4th would need 160
    out, _ = step(sched)
    assert [i.num_new_tokens for i in out.scheduled] == [1, 1, 1, 40]


def test_max_num_seqs_is_respected():
    sched = make(max_num_seqs=3)
    for i in range(5):
        sched.add(seq(f"s{i}", 2, first=10 * i))
    out, _ = step(sched)
    assert len(out.scheduled) == 3
    assert sched.num_running == 3 and sched.num_waiting == 2


def test_prefix_hit_across_requests():
    sched = make()
    sched.add(seq("a", 14))  # 3 full blocks
    run_to_completion(sched)
    sched.add(seq("b", 14))
    out, _ = step(sched)
    b = out.scheduled[0]
    assert b.seq.num_cached_tokens == 12 and b.start == 12 and b.num_new_tokens == 2
    assert sched.block_manager.prefix_cache_hit_rate > 0


def test_preemption_when_out_of_blocks_then_everything_completes():
    # 8 blocks = 32 tokens; three sequences of 6 prompt + 16 output cannot all fit at once.
    sched = make(num_blocks=8, max_model_len=32, budget=32)
    for i in range(3):
        sched.add(seq(f"s{i}", 6, first=10 * i, max_tokens=16))
    preempted = []
    finished = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out, fin = step(sched)
        finished += fin
        for victim in out.preempted:
            preempted.append(victim.seq_id)
            assert victim.status == SequenceStatus.PREEMPTED
            assert victim.block_table == [] and victim.num_computed_tokens == 0
            assert victim in sched.waiting
    assert sched.num_preemptions == len(preempted) > 0
    assert preempted[0] == "s2"  # the most recently admitted goes first
    assert sorted(s.seq_id for s in finished) == ["s0", "s1", "s2"]
    assert all(s.output_token_ids == [7] * 16 for s in finished)
    assert sched.block_manager.num_free_blocks == 8


def test_preempted_sequence_is_recomputed_with_its_output():
    sched = make(num_blocks=8, max_model_len=32, budget=32)
    for i in range(3):
        sched.add(seq(f"s{i}", 6, first=10 * i, max_tokens=16))
    while not sched.num_preemptions:
        out, _ = step(sched)
    victim = out.preempted[0]
    assert sched.waiting[0] is victim
    n_out = victim.num_output_tokens
    assert n_out > 0
    while victim.status != SequenceStatus.RUNNING:
        out, _ = step(sched)
    item = next(i for i in out.scheduled if i.seq is victim)
    assert item.is_prefill and item.start == victim.num_cached_tokens
    assert item.end == 6 + n_out  # prompt + earlier output is the new prompt


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted", "in_flight"])
def test_abort_in_every_state(state):
    sched = make(num_blocks=8, max_model_len=32, budget=8)
    if state == "preempted":
        for i in range(3):
            sched.add(seq(f"s{i}", 6, first=10 * i, max_tokens=16))
        while not sched.num_preemptions:
            out, _ = step(sched)
        target = out.preempted[0]
    else:
        sched.add(seq("s0", 20 if state == "prefilling" else 4))
        target = sched.get("s0")
        if state in ("prefilling", "decoding"):
            step(sched)
    if state == "in_flight":
        out = sched.schedule()
        assert sched.abort("s0") is target
        assert sched.postprocess(out, [7]) == []
    else:
        expected = {
            "waiting": SequenceStatus.WAITING,
            "prefilling": SequenceStatus.RUNNING,
            "decoding": SequenceStatus.RUNNING,
            "preempted": SequenceStatus.PREEMPTED,
        }[state]
        assert target.status == expected
        assert sched.abort(target.seq_id) is target
    assert target.status == SequenceStatus.FINISHED_ABORTED and target.finish_reason == "abort"
    assert target.block_table == []
    assert sched.abort(target.seq_id) is None
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == 8


def test_finish_for_stop_strings():
    sched = make()
    sched.add(seq("a", 5))
    step(sched)
    a = sched.finish("a", "stop")
    assert a.status == SequenceStatus.FINISHED_STOPPED and a.finish_reason == "stop"
    assert sched.block_manager.num_free_blocks == 64
    assert sched.abort("unknown") is None
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish("a", "eos")


def check_invariants(sched, out, kv):
    bm, config = sched.block_manager, sched.config
    refs = Counter(b for s in sched.running for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0) >= 0
    assert bm.num_free_blocks + len(refs) == bm.num_blocks
    # A block in two live tables must be a shared, fully computed prefix block.
    for bid, n in refs.items():
        if n > 1:
            for s in sched.running:
                if bid in s.block_table:
                    assert (s.block_table.index(bid) + 1) * BS <= s.num_computed_tokens
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0
    assert len(sched.running) <= config.max_num_seqs
    total = sum(i.num_new_tokens for i in out.scheduled)
    assert out.num_batched_tokens == total <= config.max_num_batched_tokens
    flags = [i.is_prefill for i in out.scheduled]
    assert flags == sorted(flags)  # decodes first
    for item in out.scheduled:
        s = item.seq
        assert s.status == SequenceStatus.RUNNING and item.start == s.num_computed_tokens
        assert len(s.block_table) * BS >= item.end
        # Every computed position holds the KV of exactly this sequence's prefix.
        tokens = s.token_ids
        for pos, slot in enumerate(bm.slot_mapping(s, 0, item.start)):
            assert kv[slot] == (len(tokens[: pos + 1]), hash(tuple(tokens[: pos + 1])))


def test_randomized_simulation_keeps_invariants():
    rng = random.Random(1234)
    sched = make(num_blocks=40, max_num_seqs=6, budget=24, max_model_len=64)
    prefixes = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
    kv: dict[int, tuple[int, int]] = {}  # slot -> (length, hash) of the prefix its KV encodes
    live: list[str] = []
    next_id = 0
    for step_i in range(600):
        if step_i < 450 and rng.random() < 0.35:
            prompt = rng.choice(prefixes)[: rng.randrange(0, 13)]
            prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            params = Params(max_tokens=rng.randrange(1, 30), min_tokens=rng.randrange(0, 3))
            s = Sequence(f"r{next_id}", prompt, params, (EOS,))
            next_id += 1
            sched.add(s)
            live.append(s.seq_id)
        if live and rng.random() < 0.04:
            victim = live.pop(rng.randrange(len(live)))
            assert sched.abort(victim) is not None
        out = sched.schedule()
        check_invariants(sched, out, kv)
        sampled = []
        for item in out.scheduled:
            s = item.seq
            tokens = s.token_ids
            for pos, slot in zip(range(item.start, item.end), bm_slots(sched, item)):
                kv[slot] = (pos + 1, hash(tuple(tokens[: pos + 1])))
            sampled.append(rng.randrange(0, 50) if item.do_sample else None)
        if out.scheduled and rng.random() < 0.02:
            # Abort while the step is "on the device": postprocess must skip it.
            item = rng.choice(out.scheduled)
            if item.seq.seq_id in live:
                live.remove(item.seq.seq_id)
                sched.abort(item.seq.seq_id)
        for s in sched.postprocess(out, sampled):
            live.remove(s.seq_id)
            assert s.block_table == []
            assert s.finish_reason in ("stop", "length")
        if step_i >= 450 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and not live
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.num_preemptions > 0
    assert sched.block_manager.prefix_cache_hit_rate > 0


def bm_slots(sched, item):
    return sched.block_manager.slot_mapping(item.seq, item.start, item.end)
