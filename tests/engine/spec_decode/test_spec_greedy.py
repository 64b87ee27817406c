"""Speculative decoding is exact under greedy sampling: the same token ids with and without it, for
K2 and K3 checkpoints, single and mixed batches with chunked prefill, preemption and prefix caching;
and whatever is rejected leaves no block or state slot behind."""

from __future__ import annotations

import random

import pytest

from kimitui.engine import LLM, SamplingParams
from tests.engine.spec_decode.scripted import ScriptedProposer
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.k3_checkpoint import write_k3_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def k2_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("k2")
    write_hf_checkpoint(path, seed=3)
    return path


@pytest.fixture(scope="module")
def k3_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3")
    write_k3_checkpoint(path, seed=5)
    return path


def _prompts(n, lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(lens[i % len(lens)])] for i in range(n)]


def _generate(path, prompts, max_tokens, proposer=None, logprobs=None, warm=(), **kw):
    """``warm``: prompts generated first, one request at a time (their blocks then are cached)."""
    llm = LLM(
        str(path),
        max_model_len=256,
        max_num_seqs=kw.pop("max_num_seqs", 4),
        speculative_config=SPEC if proposer is not None else None,
        **kw,
    )
    if proposer is not None:
        llm.engine.proposer = proposer
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    for p in warm:
        llm.generate([{"prompt_token_ids": p}], params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outs


def _check_same(path, prompts, max_tokens, **kw):
    _, ref = _generate(path, prompts, max_tokens, **kw)
    answers = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    for p in kw.get("warm", ()):
        answers.setdefault(tuple(p), answers.get(tuple(p), []))
    proposer = ScriptedProposer(answers)
    llm, outs = _generate(path, prompts, max_tokens, proposer=proposer, **kw)
    for p, a, b in zip(prompts, ref, outs):
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids), f"prompt of {len(p)} tokens"
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    slots = bm.state_slots
    if slots is not None:
        assert slots.num_free_seq_slots == slots.max_num_seqs, "state slots leaked"
    return llm, ref, outs


@pytest.mark.parametrize("ckpt", ["k2", "k3"])
def test_batch_one_identical(ckpt, k2_path, k3_path):
    path = k2_path if ckpt == "k2" else k3_path
    _check_same(path, _prompts(1, [9]), 40)


@pytest.mark.parametrize("ckpt", ["k2", "k3"])
def test_mixed_batch_chunked_prefill_identical(ckpt, k2_path, k3_path):
    path = k2_path if ckpt == "k2" else k3_path
    # a 16-token step budget: long prompts arrive in chunks beside verifying decodes
    _check_same(path, _prompts(5, [3, 40, 11, 70, 5], seed=1), 24, max_num_batched_tokens=16)


@pytest.mark.parametrize("ckpt", ["k2", "k3"])
def test_preemption_identical(ckpt, k2_path, k3_path):
    path = k2_path if ckpt == "k2" else k3_path
    # 4 sequences of up to 30 + 40 tokens in a 256-token cache must preempt
    llm, _, _ = _check_same(path, _prompts(4, [30, 25]), 40, kv_cache_tokens=256)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("ckpt", ["k2", "k3"])
def test_prefix_cache_identical(ckpt, k2_path, k3_path):
    path = k2_path if ckpt == "k2" else k3_path
    shared = _prompts(1, [48], seed=7)[0]
    prompts = [shared + [5 + i] for i in range(3)] + [shared]
    llm, _, _ = _check_same(path, prompts, 20, warm=[shared])
    assert llm.engine.block_manager.prefix_cache_hit_rate > 0


def test_logprobs_are_the_target_model_s(k2_path):
    prompts = _prompts(2, [7, 12])
    _, ref = _generate(k2_path, prompts, 16, logprobs=2)
    answers = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    _, outs = _generate(k2_path, prompts, 16, proposer=ScriptedProposer(answers), logprobs=2)
    for a, b in zip(ref, outs):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == 16
        for da, db in zip(la, lb):
            assert da.keys() == db.keys()
            for t in da:
                assert db[t] == pytest.approx(da[t], abs=1e-4)


def test_max_tokens_and_stop_tokens_are_not_overshot(k2_path):
    prompts = _prompts(3, [6, 9, 13], seed=2)
    _, ref = _generate(k2_path, prompts, 30)
    answers = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    llm = LLM(str(k2_path), max_model_len=256, max_num_seqs=4, speculative_config=SPEC)
    llm.engine.proposer = ScriptedProposer(answers, error_rate=0.0)
    for p, r in zip(prompts, ref):
        stop = r.outputs[0].token_ids[10]  # a token in the middle of the reference answer
        first = r.outputs[0].token_ids.index(stop)
        out = llm.generate(
            [{"prompt_token_ids": p}],
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
        )[0]
        assert list(out.outputs[0].token_ids) == list(r.outputs[0].token_ids[: first + 1])
        assert out.outputs[0].finish_reason == "stop"
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))[0]
        assert list(out.outputs[0].token_ids) == list(r.outputs[0].token_ids[:7])
