"""Decode graphs with an EAGLE-3 drafter on: decode-only steps (plain decodes and verifications) go
through ``DecodeGraphRunner`` although the target keeps aux hidden states for the drafter (before,
``keep_all_rows`` sent every such step down the eager path), and the drafter reads the aux states the
graph path left. Run on the CPU with the graph runner's static-buffer path switched on (what a GPU
captures; the emulated device takes the same path): greedy output, acceptance and the drafts
equal the eager engine's. Launch counts of the two paths: ``python -m benchmarks.spec.graph_launches``."""

from __future__ import annotations

import random

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.runner import model_runner as runner_mod
from kimitui.engine.runner.graphs import DecodeGraphRunner
from tests.helpers.checkpoints import BASE, write_hf_checkpoint
from tests.helpers.spec.eagle3_mla_checkpoint import write_mla_checkpoint

_REAL_RUN = DecodeGraphRunner.run


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    target = tmp_path_factory.mktemp("k2")
    write_hf_checkpoint(target, seed=3, num_hidden_layers=4)
    drafter = tmp_path_factory.mktemp("mla")
    write_mla_checkpoint(drafter, {**BASE, "num_hidden_layers": 4}, aux_layer_ids=(1, 2, 4), seed=2)
    return target, drafter


def _run(target, drafter, graphs: bool, monkeypatch):
    monkeypatch.setattr(runner_mod, "default_decode_graphs", lambda device: graphs)
    calls = []

    def run(self, ids, *a, **k):
        calls.append(ids.shape[0])
        return _REAL_RUN(self, ids, *a, **k)

    monkeypatch.setattr(DecodeGraphRunner, "run", run)
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3, "backoff": False}
    llm = LLM(str(target), dtype="float32", max_model_len=128, max_num_seqs=4, speculative_config=spec)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    st = llm.engine.stats().spec_decode
    graphed = llm.engine.runner.graphs is not None
    llm.engine.shutdown()
    return out, st, calls, graphed


def test_graphed_decode_steps_with_a_drafter_match_eager(ckpts, monkeypatch):
    target, drafter = ckpts
    eager, st_e, calls_e, g_e = _run(target, drafter, False, monkeypatch)
    graphed, st_g, calls_g, g_g = _run(target, drafter, True, monkeypatch)
    assert not g_e and g_g and not calls_e
    assert calls_g and max(calls_g) > 3  # verification steps (1 + k rows per sequence) took the graph path
    assert graphed == eager
    assert (st_g.num_draft_tokens, st_g.num_accepted_tokens) == (st_e.num_draft_tokens, st_e.num_accepted_tokens)
    assert st_g.num_draft_tokens > 0
