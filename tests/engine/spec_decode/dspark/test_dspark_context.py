"""The DSpark block pass reads its context in place (engine/spec_decode/dspark/attention.py
``PagedContext``: the block's latents written at their positions, absorbed MLA through the backend's
paged ``mla_decode``) and gives what the gathered copy of the context gives: on the trained tiny pair
(tests/fixtures/dspark_tiny), every in-place pass of a real generation is recomputed from a gathered
copy of the same cache and compared, and greedy output and acceptance are those of the copy path."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.spec_decode.dspark.attention import PagedContext
from kimitui.engine.spec_decode.dspark.model import DSparkDrafter
from kimitui.engine.spec_decode.dspark.proposer import DSparkProposer

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "dspark_tiny"
SPEC = {"method": "dspark", "model": str(FIXTURE / "drafter"), "num_speculative_tokens": 7, "backoff": False}


def _generate(paged: bool, monkeypatch, diffs: list):
    from benchmarks.spec.train_dspark import EVAL_PROMPTS, prompts

    real_block, real_paged = DSparkDrafter.block_hidden, DSparkProposer._paged
    seen = {}

    def paged_ctx(self, tables, firsts):
        seen["args"] = (self, tables, firsts)
        return real_paged(self, tables, firsts)

    def block_hidden(self, anchors, firsts, context, valid, block):
        out = real_block(self, anchors, firsts, context, valid, block)
        if isinstance(context, PagedContext):  # the same pass from a gathered copy of the same cache
            prop, tables, fs = seen.pop("args")
            copy, mask = prop._gathered(tables, fs)
            want = real_block(self, anchors, firsts, copy, mask, block)
            diffs.append(float((out - want).abs().max() / want.abs().max()))
        return out

    monkeypatch.setattr(DSparkProposer, "_paged", paged_ctx)
    monkeypatch.setattr(DSparkDrafter, "block_hidden", block_hidden)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(
        str(FIXTURE / "target"),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        enable_prefix_caching=False,
        speculative_config=SPEC,
    ) as llm:
        llm.engine.spec.proposer.paged_context = paged
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(*EVAL_PROMPTS)[:3]], params)
        st = llm.engine.stats().spec_decode
    return [list(o.outputs[0].token_ids) for o in outs], (st.num_draft_tokens, st.num_accepted_tokens)


@pytest.mark.slow  # two engines with the drafter: ~7 s of CPU
def test_in_place_context_read_matches_the_gathered_copy(monkeypatch):
    diffs: list[float] = []
    copied, st_c = _generate(False, monkeypatch, diffs)
    assert not diffs  # the copy path never built a paged context
    paged, st_p = _generate(True, monkeypatch, diffs)
    assert len(diffs) >= 3 and max(diffs) < 1e-5, diffs  # every in-place pass, relative to its scale
    assert paged == copied and st_p == st_c and st_p[0] > 0
