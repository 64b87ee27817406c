"""n > 1 and best_of (engine/parallel_sampling.py): choices, seeds, a prompt computed once.

The demo checkpoint (K2-shaped) and the toy hybrid model (KDA-like state, tests/helpers/toy_hybrid.py)
both run here, so the snapshot path of a hybrid prompt shared between children is covered too.
"""

from __future__ import annotations

import random

import pytest

import engine.engine as engine_module
from engine import LLM
from engine.args import EngineArgs
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers.checkpoints import BASE
from tests.helpers.toy_hybrid import ToyHybrid

BS = 16


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(max_model_len=512, max_num_seqs=8)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


def _computed_prompt(engine: LLMEngine) -> int:
    return engine.stats().computed_prompt_tokens


def test_n_returns_n_choices_reproducible_with_a_seed_and_the_prompt_computed_once(demo_llm):
    eng = demo_llm.engine
    prompt = _prompt(100)  # 6 full blocks + 4 tokens
    params = SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=7, ignore_eos=True)
    before, hits_before = _computed_prompt(eng), eng.stats().prefix_cache_hits
    [out] = demo_llm.generate({"prompt_token_ids": prompt}, params)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds, different samples
    # the prompt ran once; each other child recomputed only the last partial block (4 tokens)
    tail = len(prompt) - (len(prompt) - 1) // BS * BS
    assert _computed_prompt(eng) - before == len(prompt) + 3 * tail
    assert eng.stats().prefix_cache_hits - hits_before == 3 * (len(prompt) - tail)
    # same seed, same choices (the prompt is cached now: sampling does not depend on it)
    [again] = demo_llm.generate({"prompt_token_ids": prompt}, params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # child i samples with seed + i: child 2 is the n=1 request seeded with 9
    [single] = demo_llm.generate({"prompt_token_ids": prompt},
                                 SamplingParams(temperature=1.0, max_tokens=5, seed=9, ignore_eos=True))
    assert single.outputs[0].token_ids == out.outputs[2].token_ids


def test_best_of_returns_the_n_highest_cumulative_logprobs(demo_llm):
    prompt = _prompt(40, seed=1)
    [every] = demo_llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(max_tokens=4, n=4, seed=3, logprobs=0, ignore_eos=True))
    [best] = demo_llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=4, n=2, best_of=4, seed=3, ignore_eos=True))
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]
    assert all(c.logprobs is None for c in best.outputs)  # not asked for: ranking only
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_abort_of_a_fanned_out_request_frees_every_child(demo_llm):
    eng = demo_llm.engine
    eng.add_request("fan", {"prompt_token_ids": _prompt(50, 2)}, SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    eng.step()
    assert eng.request_ids() == ["fan"]
    assert eng.abort_request("fan")
    assert not eng.has_unfinished_requests() and eng.request_ids() == []
    assert eng.block_manager.usage == 0.0


def test_sampling_params_check_n_and_best_of():
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="best_of must be >= n"):
        SamplingParams(n=3, best_of=2)


@pytest.fixture
def hybrid_engine(monkeypatch, tmp_path):
    from transformers import DeepseekV3Config

    DeepseekV3Config(**{**BASE, "max_position_embeddings": 2048}).save_pretrained(str(tmp_path))
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: (ToyHybrid(), None))

    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineArgs(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=1024,
                                    max_num_seqs=4, kv_cache_tokens=4096, **kw))

    return make


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final = o
    return final


def test_hybrid_children_resume_from_the_prompt_snapshot_with_cold_results(hybrid_engine):
    prompt = _prompt(600, seed=3)
    params = SamplingParams(temperature=0.8, max_tokens=5, n=3, seed=11, logprobs=2, ignore_eos=True)
    warm = hybrid_engine()
    out = _run(warm, "r", prompt, params)
    tail = len(prompt) - (len(prompt) - 1) // BS * BS
    assert warm.stats().computed_prompt_tokens == len(prompt) + 2 * tail
    assert warm.stats().prefix_cache_hits == 2 * (len(prompt) - tail)
    warm.block_manager.state_slots.check_consistent()
    # each child equals its seed's single-sample run on a cold engine (no cache at all)
    cold = hybrid_engine(enable_prefix_caching=False)
    for i, c in enumerate(out.outputs):
        ref = _run(cold, f"c{i}", prompt, SamplingParams(temperature=0.8, max_tokens=5, seed=11 + i, logprobs=2,
                                                          ignore_eos=True)).outputs[0]
        assert c.token_ids == ref.token_ids
        for x, y in zip(c.logprobs, ref.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)
