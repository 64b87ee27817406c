"""Hybrid (KDA + paged) models through the whole engine: prefix snapshots give cold-run results,
and slots and blocks survive a soak of aborts and preemptions.

The model is ``tests.helpers.toy_hybrid.ToyHybrid`` (no Kimi Linear weights needed): a wrong or
stale state slot, or a bad snapshot, changes its logits.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import kimitui.engine.engine as engine_module
from kimitui.engine.args import EngineArgs
from kimitui.engine.engine import LLMEngine
from kimitui.engine.sampling_params import SamplingParams
from tests.helpers.checkpoints import BASE
from tests.helpers.toy_hybrid import ToyHybrid


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import DeepseekV3Config

    path = tmp_path_factory.mktemp("toy_hybrid")
    DeepseekV3Config(**{**BASE, "max_position_embeddings": 2048}).save_pretrained(str(path))  # config only
    return str(path)


@pytest.fixture
def make_engine(monkeypatch, model_dir):
    monkeypatch.setattr("kimitui.engine.runner.worker.load_model", lambda *a, **k: (ToyHybrid(), None))

    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineArgs(model=model_dir, device="cpu", dtype="float32", **kw))

    return make


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return outs


def assert_same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[t] - y[t]) < 1e-5 for t in x), (x, y)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)


def test_shared_prefix_resumes_from_a_snapshot_with_cold_logprobs(make_engine):
    rng = random.Random(0)
    system = [rng.randrange(320) for _ in range(600)]
    a = system + [rng.randrange(320) for _ in range(20)]
    b = system + [rng.randrange(320) for _ in range(25)]
    warm = make_engine(max_model_len=1024, max_num_seqs=4, kv_cache_tokens=4096)
    assert warm.cache_pool.num_snapshots == 4 and warm.block_manager.state_slots is not None
    assert warm.cache_pool.num_blocks == 4096 // 16  # asked-for tokens; state set aside on top
    first = run(warm, {"a": a}, GREEDY)["a"]
    assert first.metrics.num_cached_tokens == 0
    # b shares 37 blocks (592 tokens) with a; the snapshot within them is at 512 (every 32 blocks).
    shared = run(warm, {"b": b}, GREEDY)["b"]
    assert shared.metrics.num_cached_tokens == 512
    # A repeat of a resumes from the snapshot at its prompt's last full block.
    again = run(warm, {"a2": a}, GREEDY)["a2"]
    assert again.metrics.num_cached_tokens == 608
    assert_same(again, first)

    cold = make_engine(max_model_len=1024, max_num_seqs=4, kv_cache_tokens=4096, enable_prefix_caching=False)
    assert cold.cache_pool.num_snapshots == 0
    cold_b = run(cold, {"b": b}, GREEDY)["b"]
    assert cold_b.metrics.num_cached_tokens == 0
    assert_same(shared, cold_b)
    slots = warm.block_manager.state_slots
    assert slots.num_free_seq_slots == 4 and slots.num_snapshots_held >= 2
    slots.check_consistent()


def test_200_requests_with_aborts_and_preemptions_leave_no_slot_or_block(make_engine):
    rng = random.Random(5)
    prefixes = [[rng.randrange(320) for _ in range(n)] for n in (24, 40, 57)]
    # 24 blocks of 16 for 8 sequences of up to ~110 tokens: the scheduler must preempt.
    eng = make_engine(max_model_len=256, max_num_seqs=8, kv_cache_tokens=384, max_num_batched_tokens=64)
    eng.scheduler.config = dataclasses.replace(eng.scheduler.config, snapshot_every_blocks=2)
    prompts, aborted, done = {}, set(), {}
    for i in range(200):
        head = rng.choice(prefixes + [[]])
        ids = head + [rng.randrange(320) for _ in range(rng.randrange(1, 50))]
        rid = f"r{i}"
        prompts[rid] = ids
        eng.add_request(
            rid,
            {"prompt_token_ids": ids},
            SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 9), ignore_eos=True),
        )
        for _ in range(rng.randrange(0, 3)):
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        live = [r for r in eng.request_ids() if r not in done]
        if live and rng.random() < 0.2:
            victim = rng.choice(live)
            assert eng.abort_request(victim)
            aborted.add(victim)
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)

    bm, slots = eng.block_manager, eng.block_manager.state_slots
    assert eng.scheduler.num_preemptions > 0 and bm.num_prefix_hit_tokens > 0
    assert bm.num_free_blocks == bm.num_blocks
    assert slots.num_free_seq_slots == 8 and slots.held_by() == {}
    slots.check_consistent()
    assert slots.num_snapshots_held > 0

    # Every request that ran to the end gives what it gives alone, on a cold engine.
    ref = make_engine(max_model_len=256, max_num_seqs=1, kv_cache_tokens=512, enable_prefix_caching=False)
    finished = sorted(set(done) - aborted, key=lambda r: int(r[1:]))
    assert len(finished) > 120
    for rid in finished:
        params = SamplingParams(temperature=0.0, max_tokens=len(done[rid].outputs[0].token_ids), ignore_eos=True)
        alone = run(ref, {rid: prompts[rid]}, params)[rid]
        assert alone.outputs[0].token_ids == done[rid].outputs[0].token_ids, rid


def test_memory_budget_sets_aside_state_slots_before_snapshots_and_blocks(make_engine, monkeypatch):
    monkeypatch.setattr(engine_module, "expert_placement_for", lambda *a, **k: None)  # the planner counts K2 weights
    model = ToyHybrid()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    mla, kda = model.cache_specs(torch.float32)
    per_block, per_slot = mla.bytes_per_block(16), kda.bytes_per_seq()
    # 4 sequence slots, room for 2 of the 4 wanted snapshots once a max_model_len sequence's 16 blocks fit.
    left = 16 * per_block + (4 + 2) * per_slot + per_slot // 2
    eng = make_engine(max_model_len=256, max_num_seqs=4, gpu_memory_gb=(weights + left) / 2**30)
    assert (eng.cache_pool.num_blocks, eng.cache_pool.num_snapshots) == (16, 2)
    assert eng.block_manager.state_slots.num_slots == 6
    assert eng.cache_pool[1].num_slots == 6
    assert eng.cache_pool.num_bytes <= left


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    path = tmp_path_factory.mktemp("k3_hybrid")
    write_k3_checkpoint(path, seed=2)  # KDA layers 1, 2, 4 (2 heads); MLA layers 3, 5
    return str(path)


def _k3_engine(path, **kw) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model=path, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4, kv_cache_tokens=1024, **kw
        )
    )


def _k3_prompts():
    rng = random.Random(1)
    system = [rng.randrange(3, 250) for _ in range(150)]
    a = system + [rng.randrange(3, 250) for _ in range(30)]  # snapshots at 64, 128 and 176
    b = system + [rng.randrange(3, 250) for _ in range(12)]  # shares 9 blocks: resumes at 128
    return a, b


def _k3_warm_runs(warm: LLMEngine):
    """a cold, b sharing a's prefix, then a again, on one engine (4 snapshot slots: none evicted)."""
    assert warm.block_manager.state_slots is not None and warm.cache_pool.num_snapshots == 4
    warm.scheduler.config = dataclasses.replace(warm.scheduler.config, snapshot_every_blocks=4)  # every 64
    a, b = _k3_prompts()
    first = run(warm, {"a": a}, GREEDY)["a"]
    shared = run(warm, {"b": b}, GREEDY)["b"]
    again = run(warm, {"a2": a}, GREEDY)["a2"]
    assert [o.metrics.num_cached_tokens for o in (first, shared, again)] == [0, 128, 176]
    return first, shared, again


def _assert_close(x, y, tol=1e-4):
    assert x.outputs[0].token_ids == y.outputs[0].token_ids
    for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
        assert p.keys() == q.keys() and all(abs(p[t] - q[t]) < tol for t in p), (p, q)


@pytest.fixture(scope="module")
def k3_cold(k3_dir):
    return run(_k3_engine(k3_dir, enable_prefix_caching=False), {"b": _k3_prompts()[1]}, GREEDY)["b"]


def test_tiny_k3_shared_prefix_matches_a_cold_run(k3_dir, k3_cold):
    """The same through a real tiny Kimi K3 model."""
    first, shared, again = _k3_warm_runs(_k3_engine(k3_dir))
    _assert_close(shared, k3_cold)
    _assert_close(again, first)


def test_tiny_k3_snapshots_under_tensor_parallel(k3_dir, k3_cold):
    """Two ranks, one KDA head each: both apply the same slots and snapshot copies to their shard."""
    eng = _k3_engine(k3_dir, tensor_parallel_size=2)
    try:
        first, shared, again = _k3_warm_runs(eng)
    finally:
        eng.shutdown()
    _assert_close(shared, k3_cold)
    _assert_close(again, first)
