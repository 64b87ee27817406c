"""The last layer computes outputs only for the rows a step uses, and that changes nothing."""

from __future__ import annotations

import random

import pytest

import kimitui.engine.runner.model_runner as runner
from kimitui.engine import LLM, SamplingParams
from kimitui.engine.runner.model_runner import PromptLogprobSpan, StepInputs, output_rows
from tests.helpers.checkpoints import write_hf_checkpoint


def _inputs(num_decodes, prefills, sample_rows, span_rows=()):
    total = num_decodes + sum(n for n in prefills)
    chunks, row = [], num_decodes
    for n in prefills:
        chunks.append((row, row + n, n, [0]))
        row += n
    spans = [PromptLogprobSpan("s", r, 1, 1, [0], 1) for r in span_rows]
    return StepInputs(
        [0] * total, num_decodes, [[0]] * num_decodes, [1] * num_decodes, chunks, list(sample_rows), spans
    )


def test_each_chunk_keeps_the_suffix_it_needs():
    # 2 decodes; a finished prompt (rows 2-5, samples row 5); an unfinished one (rows 6-8); a
    # prompt-logprob chunk (rows 9-11, samples row 11).
    keep, bounds = output_rows(_inputs(2, [4, 3, 3], [0, 1, 5, 11], span_rows=[9]))
    assert keep == [0, 1, 5, 9, 10, 11]
    assert bounds == [(2, 3), (3, 3), (3, 6)]


def test_every_row_needed_means_no_pruning():
    assert output_rows(_inputs(3, [], [0, 1, 2])) == (None, [])
    assert output_rows(_inputs(0, [1], [0])) == (None, [])


def test_a_step_that_needs_no_row_keeps_its_last_row():
    keep, bounds = output_rows(_inputs(0, [4, 5], []))
    assert keep == [8] and bounds == [(0, 0), (0, 1)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("output_rows")
    write_hf_checkpoint(path, seed=11, num_hidden_layers=2)
    return str(path)


def _run(ckpt, monkeypatch, prune: bool):
    if not prune:
        monkeypatch.setattr(runner, "output_rows", lambda inp: (None, []))
    rng = random.Random(5)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 40, 21, 9, 60)]
    # A 24-token budget mixes decodes with chunks that do and do not finish their prompt.
    llm = LLM(ckpt, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, enable_prefix_caching=False)
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True, prompt_logprobs=1 if i == 1 else None
        )
        for i in range(len(prompts))
    ]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_pruned_last_layer_gives_the_same_tokens_and_logprobs(ckpt, monkeypatch):
    pruned = _run(ckpt, monkeypatch, prune=True)
    full = _run(ckpt, monkeypatch, prune=False)
    for a, b in zip(pruned, full):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    pa, pb = pruned[1].prompt_logprobs, full[1].prompt_logprobs
    assert pa is not None and len(pa) == len(pb) == 40
    for la, lb in zip(pa[1:], pb[1:]):
        assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)
