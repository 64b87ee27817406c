"""Host experts of an INT4 checkpoint with most experts offloaded: the layers share one staging block,
a CPU-only run never allocates it, and the overlap timing sums what each layer's host call cost."""

from __future__ import annotations

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.offload import overlap_meter
from kimitui.engine.offload.cpu_experts import CpuExpertExecutor
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

pytestmark = pytest.mark.skipif(not cpu_quant_moe.available(), reason="the C++ extension does not build here")


def test_host_layers_share_staging_and_report_their_overlap(tmp_path, monkeypatch):
    monkeypatch.delenv("KIMITUI_OFFLOAD_TIMING", raising=False)
    hf = write_hf_checkpoint(tmp_path, seed=3, num_hidden_layers=3)
    quantize_checkpoint(tmp_path, "int4", hf)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=1, cpu_offload=6) as llm:
        model = llm.engine.model
        executors = [m.executor for m in model.modules() if isinstance(getattr(m, "executor", None), CpuExpertExecutor)]
        assert len(executors) == 2  # layers 1 and 2 (layer 0 is dense)
        assert executors[0].staging is executors[1].staging
        assert all(e.timing is None for e in executors)  # off unless asked for
        assert overlap_meter.enable(model) == 2
        llm.generate([[1, 2, 3, 4, 5]], params)
        rep = overlap_meter.report(model)
        assert executors[0].staging.allocations == 0  # CPU tensors go to the worker as they are
    assert set(rep["layers"]) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    for row in rep["layers"].values():
        assert row["calls"] == 4  # the prefill and three decode steps
        assert row["host_s"] > 0 and row["device_s"] > 0 and row["wait_s"] >= 0
        assert 0.0 <= row["hidden_fraction"] <= 1.0
    total = rep["total"]
    assert total["calls"] == 8
    assert total["host_s"] == pytest.approx(sum(r["host_s"] for r in rep["layers"].values()))
    assert total["hidden_fraction"] == pytest.approx(max(0.0, 1 - total["wait_s"] / total["host_s"]))


def test_timing_is_switched_on_by_the_environment_when_the_model_is_built(monkeypatch):
    import torch

    class _Stack:
        num = 1

    monkeypatch.setenv("KIMITUI_OFFLOAD_TIMING", "1")
    on = CpuExpertExecutor(_Stack(), torch.tensor([0]))
    monkeypatch.setenv("KIMITUI_OFFLOAD_TIMING", "0")
    off = CpuExpertExecutor(_Stack(), torch.tensor([0]))
    assert on.timing is not None and off.timing is None
    on.shutdown()
    off.shutdown()
