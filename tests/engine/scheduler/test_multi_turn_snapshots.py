"""Multi-turn reuse on hybrid models: a finished request keeps a KDA state snapshot at the last full
block of prompt + reply, so the next turn resumes there with cold-run results (scheduler module doc).

The toy hybrid model (tests/helpers/toy_hybrid.py) changes its logits on any wrong or stale state;
the demo-k3 checkpoint (real KDA + MLA layers, random weights) is the acceptance run.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

import kimitui.engine.engine as engine_module
from kimitui.engine.args import EngineArgs
from kimitui.engine.engine import LLMEngine
from kimitui.engine.sampling_params import SamplingParams
from tests.helpers.checkpoints import BASE
from tests.helpers.engine_run import run_to_finish as _run
from tests.helpers.toy_hybrid import ToyHybrid

BS = 16


def _ids(n: int, seed: int, hi: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, hi) for _ in range(n)]


@pytest.fixture
def toy(monkeypatch, tmp_path):
    from transformers import DeepseekV3Config

    DeepseekV3Config(**{**BASE, "max_position_embeddings": 2048}).save_pretrained(str(tmp_path))
    monkeypatch.setattr("kimitui.engine.runner.worker.load_model", lambda *a, **k: (ToyHybrid(), None))

    def make(**kw) -> LLMEngine:
        return LLMEngine(
            EngineArgs(
                model=str(tmp_path),
                device="cpu",
                dtype="float32",
                max_model_len=1024,
                max_num_seqs=4,
                kv_cache_tokens=4096,
                **kw,
            )
        )

    return make


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True)


def _assert_same(a, b):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x), (x, y)


def test_second_turn_resumes_after_the_first_turns_reply(toy):
    warm = toy()
    p1 = _ids(100, 0)
    first = _run(warm, "t1", p1, GREEDY).outputs[0]
    slots = warm.block_manager.state_slots
    # one snapshot at the prompt's last full block (96), one at the reply's (139 computed -> 128):
    # the tail snapshots at 112 was replaced by the one at 128
    assert slots.num_snapshots_held == 2
    slots.check_consistent()
    p2 = p1 + first.token_ids + _ids(20, 1)
    second = _run(warm, "t2", p2, GREEDY)
    assert second.metrics.num_cached_tokens == (len(p1) + len(first.token_ids) - 1) // BS * BS == 128
    cold = toy(enable_prefix_caching=False)
    _assert_same(second.outputs[0], _run(cold, "c2", p2, GREEDY).outputs[0])
    slots.check_consistent()


def test_without_request_end_snapshots_the_second_turn_resumes_at_the_first_prompt(toy):
    eng = toy()
    eng.scheduler.config = dataclasses.replace(eng.scheduler.config, snapshot_request_end=False)
    p1 = _ids(100, 0)
    first = _run(eng, "t1", p1, GREEDY).outputs[0]
    second = _run(eng, "t2", p1 + first.token_ids + _ids(20, 1), GREEDY)
    assert second.metrics.num_cached_tokens == 96


def test_snapshot_interval_flag_reaches_the_scheduler(toy):
    assert toy(state_snapshot_interval=64).scheduler.config.snapshot_every_blocks == 4
    with pytest.raises(ValueError, match="state_snapshot_interval must be a positive multiple of block_size"):
        EngineArgs(state_snapshot_interval=100)


@pytest.mark.slow
def test_demo_k3_second_turn_is_cached_through_the_reply_with_cold_prompt_logprobs():
    """Acceptance on demo-k3: turn 2's cached tokens cover turn 1's prompt and reply (to the block),
    and the log-probs of every turn-2 prompt position after the hit equal a cold run's prompt log-probs."""
    args = dict(model="demo-k3", device="cpu", max_model_len=512, kv_cache_tokens=2048, max_num_seqs=4)
    warm = LLMEngine(EngineArgs(**args))
    assert warm.block_manager.state_slots is not None
    vocab = warm.config.vocab_size
    p1 = _ids(70, 2, hi=min(vocab, 1000))
    first = _run(warm, "t1", p1, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)).outputs[0]
    p2 = p1 + first.token_ids + _ids(12, 3, hi=min(vocab, 1000))
    hit = (len(p1) + len(first.token_ids) - 1) // BS * BS  # 99 computed -> 96
    second = _run(warm, "t2", p2, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert second.metrics.num_cached_tokens == hit > len(p1)
    # warm: the next-token distribution after each prefix p2[:j] past the hit, each resuming from
    # the tail snapshot; cold: prompt log-probs of p2 on an engine without any cache
    k = 5
    for j in range(hit + 1, len(p2)):
        warm.add_request(
            f"w{j}",
            {"prompt_token_ids": p2[:j]},
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True),
        )
    got = {}
    while warm.has_unfinished_requests():
        got.update((o.request_id, o) for o in warm.step() if o.finished)
    cold = LLMEngine(EngineArgs(**args, enable_prefix_caching=False))
    ref = _run(
        cold, "c", p2, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, ignore_eos=True)
    ).prompt_logprobs
    for j in range(hit + 1, len(p2)):
        out = got[f"w{j}"]
        assert out.metrics.num_cached_tokens == hit
        w, c = out.outputs[0].logprobs[0], ref[j]
        top_w = sorted(w, key=w.get, reverse=True)[:k]
        top_c = sorted(c, key=c.get, reverse=True)[:k]
        assert top_w == top_c, (j, w, c)
        assert all(abs(w[t] - c[t]) < 1e-4 for t in top_w), (j, w, c)
