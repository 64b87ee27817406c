import math

import numpy as np
import pytest

from kimitui.bench.workload import clip_to_context, length_bounds, sample_random
from tests.kimitui.bench_fakes import ExpandingTokenizer, SplittingTokenizer, WordTokenizer


def test_length_bounds_are_vllm_floor_ceil():
    assert length_bounds(1000, 0.25) == (750, 1250)
    assert length_bounds(7, 0.5) == (math.floor(3.5), math.ceil(10.5))
    assert length_bounds(1, 0.9, low_min=1) == (1, 2)  # output low clamped to 1
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        length_bounds(100, 1.0)


def test_range_ratio_bounds_and_determinism():
    tok = WordTokenizer()
    w1 = sample_random(tok, 200, input_len=100, output_len=50, range_ratio=0.2, seed=3)
    w2 = sample_random(tok, 200, input_len=100, output_len=50, range_ratio=0.2, seed=3)
    w3 = sample_random(tok, 200, input_len=100, output_len=50, range_ratio=0.2, seed=4)
    ins = [r.prompt_len for r in w1.requests]
    outs = [r.expected_output_len for r in w1.requests]
    assert min(ins) >= 80 and max(ins) <= 120 and len(set(ins)) > 10
    assert min(outs) >= 40 and max(outs) <= 60
    assert w1 == w2
    assert [r.prompt_token_ids for r in w1.requests] != [r.prompt_token_ids for r in w3.requests]
    assert w1.note is None


def test_lengths_match_vllm_rng_order():
    # vLLM draws input lens, output lens, offsets from one default_rng(seed), in that order.
    rng = np.random.default_rng(7)
    # Same float arithmetic as vLLM: ceil(100 * 1.1) is 111, ceil(20 * 1.1) is 23.
    want_in = rng.integers(math.floor(100 * 0.9), math.ceil(100 * (1 + 0.1)) + 1, size=5)
    want_out = rng.integers(math.floor(20 * 0.9), math.ceil(20 * (1 + 0.1)) + 1, size=5)
    offsets = rng.integers(0, 500, size=5)
    w = sample_random(WordTokenizer(), 5, 100, 20, range_ratio=0.1, seed=7)
    assert [r.prompt_len for r in w.requests] == want_in.tolist()
    assert [r.expected_output_len for r in w.requests] == want_out.tolist()
    allowed = np.arange(3, 500)
    first = allowed[(offsets[0] + 0 + np.arange(want_in[0])) % len(allowed)].tolist()
    assert w.requests[0].prompt_token_ids == first


def test_no_special_ids_and_text_round_trip():
    tok = WordTokenizer()
    w = sample_random(tok, 20, 64, 8, prefix_len=5, seed=1)
    prefix = w.requests[0].prompt_token_ids[:5]
    for r in w.requests:
        assert not set(r.prompt_token_ids) & tok.special_ids
        assert r.prompt_len == 69 == len(r.prompt_token_ids)
        assert tok.encode(r.prompt) == r.prompt_token_ids
        assert r.prompt_token_ids[:5] == prefix


def test_ids_only_workload_has_exact_lengths():
    w = sample_random(SplittingTokenizer(), 10, 50, 8, range_ratio=0.5, seed=2, text=False)
    for r in w.requests:
        assert r.prompt is None and len(r.prompt_token_ids) == r.prompt_len


def test_decode_reencode_converges_to_target():
    tok = SplittingTokenizer()
    w = sample_random(tok, 10, 50, 8, seed=2)
    assert any(3 in r.prompt_token_ids for r in w.requests)  # some prompts did drift
    for r in w.requests:
        assert r.prompt_len == 50
        assert tok.encode(r.prompt) == r.prompt_token_ids
    assert w.note is None


def test_unconverged_prompts_are_noted():
    w = sample_random(ExpandingTokenizer(), 10, 50, 8, seed=2)
    assert "more prompt tokens than sampled" in w.note


def test_clip_to_context_reports_a_note():
    w = sample_random(WordTokenizer(), 4, 100, 50, seed=0, max_model_len=120)
    assert all(r.prompt_len + r.expected_output_len <= 120 for r in w.requests)
    assert "max_model_len=120" in w.note
    reqs, note = clip_to_context(w.requests, 60, WordTokenizer())
    assert all(r.prompt_len == 59 and r.expected_output_len == 1 for r in reqs)
    assert all(WordTokenizer().encode(r.prompt) == r.prompt_token_ids for r in reqs)
    assert "4 prompt(s) truncated" in note
    assert clip_to_context(reqs, 1000)[1] is None
