"""Continuous batching stays exactly as correct as one request at a time."""

from __future__ import annotations

import random

import pytest

from kimitui.engine import LLM, SamplingParams
from tests.helpers.checkpoints import write_hf_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("batching")
    write_hf_checkpoint(path, seed=7, n_group=2, topk_group=1, num_hidden_layers=2)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(320) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100, 3, 48)]


@pytest.fixture(scope="module")
def sequential(ckpt, prompts):
    llm = LLM(ckpt, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False)
    return [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_one_at_a_time(ckpt, prompts, sequential):
    llm = LLM(ckpt, max_model_len=256, max_num_seqs=8, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY)) == sequential


def test_chunked_prefill_equals_unchunked(ckpt, prompts, sequential):
    # A 16-token budget splits every long prompt into chunks mixed with other requests' decodes.
    llm = LLM(ckpt, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY)) == sequential


def test_prefix_cache_hit_gives_same_tokens_and_is_counted(ckpt, prompts, sequential):
    llm = LLM(ckpt, max_model_len=256, max_num_seqs=4)
    first = llm.generate({"prompt_token_ids": prompts[5]}, GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    again = llm.generate({"prompt_token_ids": prompts[5]}, GREEDY)[0]
    assert again.outputs[0].token_ids == sequential[5]
    assert again.metrics.num_cached_tokens == 96  # 6 full blocks of 16 out of 100 prompt tokens
    assert llm.engine.stats().prefix_cache_hit_rate > 0.4


def test_preemption_under_a_tiny_cache_gives_same_tokens(ckpt, prompts, sequential):
    # 288 tokens of cache for 8 requests needing up to 112 each: the scheduler must preempt and recompute.
    llm = LLM(ckpt, max_model_len=256, max_num_seqs=8, kv_cache_tokens=288, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert _tokens(outs) == sequential
    assert llm.engine.stats().num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_many_requests_with_random_aborts_free_every_block(ckpt):
    llm = LLM(ckpt, max_model_len=128, max_num_seqs=16, kv_cache_tokens=1024)
    engine = llm.engine
    rng = random.Random(11)
    live: set[str] = set()
    for i in range(200):
        ids = [rng.randrange(320) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 8), seed=i)
        live.add(engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params))
        if rng.random() < 0.5:
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
        if live and rng.random() < 0.2:
            victim = rng.choice(sorted(live))
            assert engine.abort_request(victim)
            live.discard(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    assert not live and not engine.request_ids()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_is_independent_of_batch(ckpt, prompts):
    llm = LLM(ckpt, max_model_len=256, max_num_seqs=8)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=42, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[2]}, params)[0].outputs[0].token_ids
    batched = llm.generate(prompts, params)[2].outputs[0].token_ids
    assert alone == batched


def test_logprobs_hold_top_k_and_the_chosen_token(ckpt, prompts):
    llm = LLM(ckpt, max_model_len=256, max_num_seqs=2)
    out = llm.generate(
        {"prompt_token_ids": prompts[3]},
        SamplingParams(temperature=1.0, max_tokens=6, logprobs=3, seed=1, ignore_eos=True),
    )[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 6
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
        best = sorted(lp.values(), reverse=True)[:3]
        assert max(lp.values()) == best[0]
