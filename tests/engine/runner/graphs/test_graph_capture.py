"""Decode graphs captured at start-up, bucket by bucket, and a failed capture that disables only its
bucket (engine/runner/graphs.py).

There is no device here, so ``DecodeGraphRunner._capture`` is replaced by one that does what it does
around the recording (two warm-up passes, then the pass a graph would record) with a "graph" whose
replay reruns that pass into the recorded output, and that fails, as an injected capture failure,
for bucket 4. The runner's own bookkeeping is real: which buckets it captures and in which order,
what the padding-only start-up inputs write (nothing), which steps replay and which run direct calls.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimitui.engine import LLM
from kimitui.engine.runner.graphs import DecodeGraphRunner
from kimitui.engine.runner.model_runner import ModelRunner, StepInputs
from tests.helpers.checkpoints import write_hf_checkpoint

MAX_SEQS = 8
FAILING = 4


class _Graph:
    def __init__(self, replay):
        self.replay = replay


@pytest.fixture()
def runners(tmp_path, monkeypatch):
    write_hf_checkpoint(tmp_path, seed=5, num_hidden_layers=2)
    llm = LLM(str(tmp_path), max_model_len=96, max_num_seqs=MAX_SEQS, enable_prefix_caching=False, kv_cache_tokens=512)
    eager = llm.engine.runner
    graphed = ModelRunner(
        eager.model,
        eager.kv_caches,
        eager.block_size,
        eager.device,
        max_num_seqs=MAX_SEQS,
        max_model_len=96,
        decode_graphs=True,
    )
    g = graphed.graphs
    g.cfg = dataclasses.replace(g.cfg, capture=True)  # as on a device; _capture below stands in for CUDA
    log = {"captured": [], "replays": []}

    def capture(self, b):
        log["captured"].append(b)
        if b == FAILING:
            raise RuntimeError("injected: operation not permitted when stream is capturing")
        for _ in range(2):
            self._forward(b)
        out = self._forward(b)

        def replay():
            log["replays"].append(b)
            out.copy_(self._forward(b))

        self._graphs[b] = (_Graph(replay), out)
        return self._graphs[b]

    monkeypatch.setattr(DecodeGraphRunner, "_capture", capture)
    return eager, graphed, log


def _step(n: int) -> StepInputs:
    return StepInputs(
        ids=list(range(11, 11 + n)),
        num_decodes=n,
        decode_tables=[[i] for i in range(1, n + 1)],
        decode_lens=[3 + i for i in range(n)],
        prefills=[],
        sample_rows=list(range(n)),
    )


def test_startup_capture_of_every_bucket_and_one_failed_bucket(runners):
    eager, graphed, log = runners
    g = graphed.graphs
    torch.manual_seed(0)
    for c in eager.kv_caches:
        c.normal_()
    before = [c.clone() for c in eager.kv_caches]
    g.capture_all()
    assert log["captured"] == [8, 4, 2, 1]  # largest first: the shared pool is sized by the largest
    assert sorted(g._graphs) == [1, 2, 8] and list(g.failed) == [FAILING]
    assert "injected" in g.failed[FAILING]
    assert all(torch.equal(a, b) for a, b in zip(eager.kv_caches, before))  # padding rows wrote nothing
    g.capture_all()  # idempotent: neither a captured nor a failed bucket is tried again
    assert log["captured"] == [8, 4, 2, 1]

    for n, replayed in ((3, False), (5, True), (2, True)):  # bucket 4 runs direct calls, 8 and 2 replay
        for c, b in zip(eager.kv_caches, before):
            c.copy_(b)
        want, _ = eager.forward_step(_step(n))
        want_caches = [c.clone() for c in eager.kv_caches]
        for c, b in zip(eager.kv_caches, before):
            c.copy_(b)
        log["replays"].clear()
        got, _ = graphed.forward_step(_step(n))
        assert bool(log["replays"]) == replayed, (n, log["replays"])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(eager.kv_caches, want_caches):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert log["captured"] == [8, 4, 2, 1]  # no lazy retry of the failed bucket mid-serving


def test_lazy_capture_captures_a_bucket_on_its_first_step(runners):
    _, graphed, log = runners
    graphed.forward_step(_step(3))
    assert log["captured"] == [FAILING] and list(graphed.graphs.failed) == [FAILING]
    graphed.forward_step(_step(5))
    assert log["captured"] == [FAILING, 8] and sorted(graphed.graphs._graphs) == [8]
    graphed.forward_step(_step(3))  # still direct calls, no second attempt
    assert log["captured"] == [FAILING, 8]


def test_lazy_graph_capture_flag_reaches_engine_args():
    import argparse

    from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from
    from kimitui.engine.args import EngineArgs

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_args_from(p.parse_args(["--lazy-graph-capture"])).lazy_graph_capture is True
    assert engine_args_from(p.parse_args([])).lazy_graph_capture is False
    assert EngineArgs().lazy_graph_capture is False
