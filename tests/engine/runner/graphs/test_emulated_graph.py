"""The CPU stand-in for CUDA graphs (engine/runner/emulated_graph.py), the segmented capture built on it
(engine/runner/piecewise.py) and the frozen host staging those graphs capture."""

from __future__ import annotations

import pytest
import torch

from kimitui.engine.offload.host_staging import HostStaging
from kimitui.engine.runner.emulated_graph import EmulatedGraph, GraphCaptureError
from kimitui.engine.runner.piecewise import segmented_capture
from kimitui.kernels.launch_count import count_launches


def test_replay_reruns_the_kernels_on_the_same_tensors_without_the_python():
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    acc = torch.zeros(4, 5)
    calls = []

    def region():
        calls.append(1)  # Python: runs at capture only
        y = a @ b + 1.0  # new tensors: replays write into them
        acc.add_(y.relu())  # in place on a static tensor
        return y.t().contiguous()  # a view, then a copy

    g = EmulatedGraph()
    g.capture_begin()
    out = region()
    g.capture_end()
    assert len(calls) == 1 and g.num_launches >= 4
    a.copy_(torch.randn(4, 3))  # new step inputs, same addresses
    acc.zero_()
    g.replay()
    assert len(calls) == 1  # the Python did not run again
    torch.testing.assert_close(out, (a @ b + 1.0).t(), rtol=0, atol=0)
    torch.testing.assert_close(acc, (a @ b + 1.0).relu(), rtol=0, atol=0)


def test_capture_freezes_python_values_as_a_gpu_graph_does():
    x = torch.ones(3)
    out = torch.zeros(3)
    n = {"rows": 2}

    def region():
        out[: n["rows"]].copy_(x[: n["rows"]] * 2)  # the row count is Python: frozen at capture

    g = EmulatedGraph()
    g.capture_begin()
    region()
    g.capture_end()
    n["rows"] = 3
    out.zero_()
    g.replay()
    assert out.tolist() == [2.0, 2.0, 0.0]  # still two rows: what a GPU would replay too


def test_a_host_sync_inside_a_capture_raises():
    x = torch.ones(3)
    g = EmulatedGraph()
    g.capture_begin()
    with pytest.raises(GraphCaptureError, match="sync"):
        try:
            int(x.sum())
        finally:
            g.capture_end()


def test_a_replay_is_one_launch_and_its_ops_are_not_counted_again():
    x = torch.randn(8)
    y = torch.empty(8)
    g = EmulatedGraph()
    g.capture_begin()
    y.copy_(x.exp() * 2 + 1)
    g.capture_end()
    with count_launches() as eager:
        y.copy_(x.exp() * 2 + 1)
    with count_launches() as replayed:
        g.replay()
    assert eager.kernels >= 4 and not eager.graphs
    assert replayed.kernels == 0 and replayed.graphs["emulated"] == 1 and replayed.launches == 1


class _Cutter:
    """A stand-in for a MoE layer with host experts: it cuts the capture where it joins."""

    graph_breaks = None

    def __init__(self, log: list):
        self.log = log

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        staged = h * 3  # captured before the cut
        self.graph_breaks.cut(lambda: self.log.append("host"))
        return staged + 1  # captured after


def test_segmented_capture_runs_the_host_actions_between_the_segments():
    log: list = []
    layers = [_Cutter(log), _Cutter(log)]
    x = torch.randn(5)

    def forward():
        h = x + 0
        for m in layers:
            h = m(h)
        return h * 2

    graph, out = segmented_capture(EmulatedGraph, forward, layers, kind="emulated")
    assert graph.num_segments == 3 and log == []  # the actions do not run at capture
    assert all(m.graph_breaks is None for m in layers)
    x.copy_(torch.randn(5))
    with count_launches() as counts:
        graph.replay()
    assert log == ["host", "host"] and counts.graphs["emulated"] == 3 and counts.kernels == 0
    torch.testing.assert_close(out, (((x * 3 + 1) * 3) + 1) * 2)


def test_frozen_staging_refuses_to_move():
    s = HostStaging()
    s.reserve(8, torch.device("cpu"), torch.float16, 64, 2)
    s.frozen = True
    s.reserve(5, torch.device("cpu"), torch.float16, 64, 2)  # fits: nothing moves
    assert s.allocations == 1
    with pytest.raises(ValueError, match="captured by decode graphs"):
        s.reserve(9, torch.device("cpu"), torch.float16, 64, 2)
    with pytest.raises(ValueError, match="captured by decode graphs"):
        s.reserve(4, torch.device("cpu"), torch.float16, 32, 2)


def test_staging_reserved_under_inference_mode_takes_the_workers_write():
    # A decode step runs under inference mode and reserves the blocks; the CPU worker thread (outside
    # inference mode) writes the output block in place. An inference tensor would refuse that write
    # ("Inplace update to inference tensor outside InferenceMode").
    import threading

    s = HostStaging()
    with torch.inference_mode():
        s.reserve(4, torch.device("cpu"), torch.float16, 64, 2)
    errors = []

    def worker():
        try:
            s.output(4).copy_(torch.ones(4, 64, dtype=torch.float16))
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors
    assert s.output(4).eq(1).all()


def test_emulated_capture_is_refused_off_the_emulated_device(monkeypatch):
    # the CPU backend's C++ kernels are pybind calls no recording sees: a replay would skip them
    from kimitui.engine.runner.graphs import DecodeGraphRunner, GraphConfig

    monkeypatch.delenv("KIMITUI_EMULATE_DEVICE", raising=False)
    cfg = GraphConfig(4, 2, 16, capture=False, emulate=True)
    with pytest.raises(ValueError, match="KIMITUI_EMULATE_DEVICE=1"):
        DecodeGraphRunner(None, [], cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="exclude each other"):
        GraphConfig(4, 2, 16, capture=True, emulate=True)


def test_an_offloaded_engine_keeps_its_decode_graphs(tmp_path):
    # --cpu-offload used to turn decode graphs off for the whole model (LLMEngine._decode_graphs)
    from kimitui.engine import LLM
    from tests.helpers.checkpoints import write_hf_checkpoint

    write_hf_checkpoint(
        tmp_path,
        seed=5,
        num_hidden_layers=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )
    with LLM(str(tmp_path), max_model_len=64, max_num_seqs=2, cpu_offload=4, kv_cache_tokens=256) as llm:
        assert any(-1 in row for row in llm.engine.expert_placement)
        assert llm.engine._decode_graphs() is None  # the runner decides, as without offload


def test_segmented_capture_on_the_cuda_branch_shares_one_pool_and_counts_each_replay():
    # torch.cuda.CUDAGraph's calls as the GPU path makes them, with a stand-in graph (no GPU here)
    calls: list = []

    class FakeCUDAGraph:
        def capture_begin(self, pool=None):
            calls.append(("begin", pool))

        def capture_end(self):
            calls.append(("end",))

        def pool(self):
            return "pool-0"

        def replay(self):
            calls.append(("replay", id(self)))

    log: list = []
    layers = [_Cutter(log)]
    graph, _ = segmented_capture(FakeCUDAGraph, lambda: layers[0](torch.ones(2)), layers, pool="shared", kind="cuda")
    assert [c for c in calls if c[0] == "begin"] == [("begin", "shared")] * 2  # the runner's pool, every segment
    calls.clear()
    with count_launches() as counts:
        graph.replay()
    assert [c[0] for c in calls] == ["replay", "replay"] and log == ["host"]
    assert counts.graphs["cuda"] == 2 and counts.launches == 2
