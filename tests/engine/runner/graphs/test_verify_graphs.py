"""Verification steps of a hybrid target through the verify graphs (engine/runner/verify_graphs.py), on
the CPU's static-buffer path (the direct calls a GPU captures; the emulated replay is
tests/engine/runner/graphs/test_graph_verify_k3.py): the fixed layout's rows, slots and saves, and the trained
K3 + DSpark pair generating with graphs on exactly what it generates eagerly and without drafting, with
the same acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.runner import model_runner as runner_mod
from kimitui.engine.runner.graph_padding import PAD_SLOT
from kimitui.engine.runner.verify_graphs import VerifyGraphRunner

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "dspark_tiny"
_RUN_VERIFY = VerifyGraphRunner.run_verify


def test_layout_rows_slots_and_saves():
    g = VerifyGraphRunner.__new__(VerifyGraphRunner)  # layout() reads these four fields only
    g.width, g.num_spec_tokens, g.scratch_base, g.seq_buckets = 4, 3, 100, [1, 2, 4]
    # three sequences (slots 2, 0, 3) verifying 3, 1 and 0 drafts: bucket 4, one padding sequence
    lay = g.layout([4, 2, 1], [2] * 4 + [0] * 2 + [3])
    rows, n = 16, 7
    src, real, slot = lay[:rows], lay[rows : 2 * rows], lay[2 * rows : 3 * rows]
    save_src, save_dst, out = lay[3 * rows : 3 * rows + 12], lay[3 * rows + 12 : 3 * rows + 24], lay[3 * rows + 24 :]
    assert len(out) == n and sorted(out) == sorted(r for r in range(rows) if real[r])
    # position-major: row j * 4 + i is sequence i's position j
    assert out == [0, 4, 8, 12, 1, 5, 2]
    assert slot == [2, 0, 3, PAD_SLOT, 2, 0, PAD_SLOT, PAD_SLOT, 2, PAD_SLOT, PAD_SLOT, PAD_SLOT] + [2] + [PAD_SLOT] * 3
    assert [src[r] for r in out] == list(range(n))
    assert src[6] == 6 and src[3] == 0  # a padding position repeats its sequence's first row; padding sequences row 0
    # sequence 0 keeps positions 0, 1, 2 in scratch 100 + 2 * 3 + j; sequence 1 position 0; the rest copy onto themselves
    assert save_dst == [106, 100, 3, 2, 107, 0, 3, 2, 108, 0, 3, 2]
    assert save_src == [2, 0, 3, 2] * 3


@pytest.fixture(scope="module")
def prompts():
    from benchmarks.spec.train_dspark import EVAL_PROMPTS, prompts

    return prompts(*EVAL_PROMPTS)[:2]


def _run(prompts, graphs: bool, drafting: bool, monkeypatch):
    monkeypatch.setattr(runner_mod, "default_decode_graphs", lambda device: graphs)
    calls = []

    def run_verify(self, ids, *a, **k):
        calls.append(ids.shape[0])
        return _RUN_VERIFY(self, ids, *a, **k)

    monkeypatch.setattr(VerifyGraphRunner, "run_verify", run_verify)
    spec = {"method": "dspark", "model": str(FIXTURE / "drafter"), "num_speculative_tokens": 7, "backoff": False}
    kw = {"speculative_config": spec} if drafting else {}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(
        str(FIXTURE / "target"), dtype="float32", max_model_len=128, max_num_seqs=4, enable_prefix_caching=False, **kw
    ) as llm:
        out = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        st = llm.engine.stats().spec_decode
        assert (llm.engine.runner.verify_graphs is not None) == (graphs and drafting)
    return out, st, calls


@pytest.mark.slow  # three engines with the drafter: ~20 s of CPU
def test_k3_dspark_greedy_with_verify_graphs_matches_eager_and_plain(prompts, monkeypatch):
    plain, _, _ = _run(prompts, True, False, monkeypatch)
    eager, st_e, calls_e = _run(prompts, False, True, monkeypatch)
    graphed, st_g, calls_g = _run(prompts, True, True, monkeypatch)
    assert not calls_e and calls_g and max(calls_g) > len(prompts)  # verification steps took the verify graphs
    assert graphed == eager == plain
    assert st_g.num_draft_tokens > 0
    assert (st_g.num_draft_tokens, st_g.num_accepted_tokens) == (st_e.num_draft_tokens, st_e.num_accepted_tokens)
