"""Idle tensor-parallel workers wait for work without a deadline; ``KIMITUI_DIST_TIMEOUT_S`` bounds
real collectives only (engine/parallel/workers.py).

Before, a worker waited for the next step inside a gloo broadcast, so an engine left idle for
longer than the group's timeout lost its workers and failed every later request. Here a 2-rank gloo
engine with a timeout of a few seconds idles for several timeouts and must then answer like the
one-process engine; a collective rank 0 enters alone must still fail after about that timeout.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.parallel.workers import DEFAULT_DIST_TIMEOUT_S, dist_timeout_s
from tests.helpers.checkpoints import write_hf_checkpoint

SHAPE = dict(
    num_attention_heads=4,
    n_routed_experts=6,
    vocab_size=211,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    intermediate_size=64,
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("idle_tp")
    write_hf_checkpoint(path, seed=7, **SHAPE)
    return str(path)


@pytest.fixture(scope="module")
def reference(ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMITUI_CPU_KERNELS", "0")  # the PyTorch path, as in the parallel runs below
        with LLM(ckpt, max_model_len=64, max_num_seqs=2) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_timeout_setting_is_parsed_and_checked():
    assert dist_timeout_s({}) == DEFAULT_DIST_TIMEOUT_S == 1800
    assert dist_timeout_s({"KIMITUI_DIST_TIMEOUT_S": " 7.5 "}) == 7.5
    for bad in ("soon", "0", "-3", "inf", "nan"):
        with pytest.raises(ValueError, match="KIMITUI_DIST_TIMEOUT_S"):
            dist_timeout_s({"KIMITUI_DIST_TIMEOUT_S": bad})


def _lone_all_reduce_fails_within(seconds: float) -> float | None:
    """Rank 0 enters an all-reduce the idle workers never join: it must fail (the setting bounds
    real collectives). Returns how long it took, or None if it was still waiting after ``seconds``."""
    import torch.distributed as dist

    box = {}

    def run():
        t = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(1))
        except RuntimeError:
            box["took"] = time.monotonic() - t

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return box.get("took")


@pytest.mark.parametrize(
    "timeout_s,idle_s",
    [
        (3, 7),  # about 20 s on an idle 2-core machine: the case CI runs (it leaves out slow tests)
        pytest.param(5, 20, marks=pytest.mark.slow),  # the figures the issue asks for (about 40 s)
    ],
)
def test_idle_engine_outlives_the_collective_timeout(ckpt, reference, monkeypatch, timeout_s, idle_s):
    monkeypatch.setenv("KIMITUI_DIST_TIMEOUT_S", str(timeout_s))
    # the PyTorch path: the C++ kernels are not what is tested, and their first build would only slow this down
    monkeypatch.setenv("KIMITUI_CPU_KERNELS", "0")
    llm = LLM(ckpt, max_model_len=64, max_num_seqs=2, tensor_parallel_size=2)
    try:
        workers = llm.engine.workers
        assert workers.spec.dist_timeout_s == timeout_s
        time.sleep(idle_s)  # several timeouts with no request at all
        assert [p.exitcode for p in workers.procs] == [None]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
        took = _lone_all_reduce_fails_within(timeout_s + 30)
        assert took is not None and took >= timeout_s * 0.9, took
    finally:
        llm.shutdown()
    assert [p.exitcode for p in workers.procs] == [0]  # they left on rank 0's EOF, not by being killed
