"""Full-vocabulary log-prob rows (``SamplingParams.logprob_rows``, ``LLM.score_logits``) and teacher
forcing (``forced_token_ids``): the rows are the model's own log-softmax at each position, prefill
rows equal the prompt log-probs the engine already reports, decode-path rows (the reference tokens
fed back one at a time) equal the prefill rows of the same positions to float32 rounding, and
pieces never exceed the asked chunk or one step's rows."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from tests.helpers.checkpoints import hf_prompt_logprobs, write_hf_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("score")
    hf = write_hf_checkpoint(path, seed=4)
    return path, hf


def _rows(llm, ids, **kw) -> tuple[torch.Tensor, list]:
    pieces = list(llm.score_logits(ids, **kw))
    pos = 1
    for p in pieces:  # in order, contiguous, every position 1..n-1 once
        assert p.first_pos == pos
        pos += p.num_rows
    assert pos == len(ids)
    return torch.cat([p.values for p in pieces]), pieces


def test_prefill_rows_are_the_model_log_softmax(ckpt):
    path, hf = ckpt
    ids = [random.Random(1).randrange(320) for _ in range(40)]
    with LLM(str(path), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        rows, pieces = _rows(llm, ids, chunk=5)
        assert all(p.num_rows <= 5 and p.path == "prefill" for p in pieces)
        assert rows.dtype == torch.float32 and rows.shape == (39, 320)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    for i in range(1, len(ids)):  # the engine's own prompt log-probs, top-3 and actual token
        for tok, lp in out.prompt_logprobs[i].items():
            assert rows[i - 1, tok].item() == pytest.approx(lp, abs=1e-6)
    oracle = hf_prompt_logprobs(hf, ids)[:-1]  # transformers: row i predicts token i + 1
    assert (rows - oracle).abs().max().item() < 1e-4
    assert torch.allclose(rows.exp().sum(-1), torch.ones(39), atol=1e-5)


@pytest.mark.parametrize("spec", [None, SPEC])
def test_decode_rows_match_prefill_rows(ckpt, spec):
    path, _ = ckpt
    rng = random.Random(2)
    pattern = [rng.randrange(320) for _ in range(6)]
    ids = pattern * 6  # repeats, so n-gram drafts are right and verification accepts several at once
    with LLM(str(path), max_model_len=128, max_num_seqs=2, speculative_config=spec) as llm:
        prefill, _ = _rows(llm, ids)
        mixed, pieces = _rows(llm, ids, decode_from=10)
        if spec is not None:
            assert llm.engine.spec_stats.num_accepted_tokens > 0  # the verify path ran with accepted drafts
    paths = [(p.first_pos, p.path) for p in pieces]
    assert all(path == "prefill" for pos, path in paths if pos <= 10)
    assert all(path == "decode" for pos, path in paths if pos > 10) and paths[-1][1] == "decode"
    assert (mixed - prefill).abs().max().item() < 1e-4


def test_forced_tokens_replace_the_sampled_ones(ckpt):
    path, _ = ckpt
    forced = [7, 7, 300, 1, 2]
    with LLM(str(path), max_model_len=64, max_num_seqs=2) as llm:
        out = llm.generate(
            [[5, 6, 7]],
            SamplingParams(temperature=1.0, seed=3, max_tokens=7, ignore_eos=True, forced_token_ids=forced, logprobs=0),
        )[0].outputs[0]
    assert out.token_ids[:5] == forced and len(out.token_ids) == 7
    assert all(tok in lp for tok, lp in zip(out.token_ids, out.logprobs))  # scored by the model's own row


def test_bad_scoring_requests_get_one_line_errors(ckpt):
    path, _ = ckpt
    with LLM(str(path), max_model_len=32, max_num_seqs=1) as llm:
        with pytest.raises(ValueError, match="at least 2 tokens"):
            list(llm.score_logits([3]))
        with pytest.raises(ValueError, match="decode_from"):
            list(llm.score_logits([3, 4, 5], decode_from=9))
        with pytest.raises(ValueError, match="max_model_len"):
            list(llm.score_logits(list(range(40))))
    with pytest.raises(ValueError, match="forced_token_ids"):
        SamplingParams(forced_token_ids=[1, -2])
