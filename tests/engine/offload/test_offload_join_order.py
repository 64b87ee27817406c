"""With experts in host RAM, a MoE layer enqueues its shared experts before it waits for the host
experts' result (issue 38, finding 3): the device then computes them while the CPU computes its
experts, instead of idling at the join and computing them after. The sum is the same as before
(device experts + host experts, then + shared experts)."""

from __future__ import annotations

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.offload.cpu_experts import PendingHostExperts
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

pytestmark = pytest.mark.skipif(not cpu_quant_moe.available(), reason="the C++ extension does not build here")


def test_shared_experts_run_before_the_host_join(tmp_path, monkeypatch):
    hf = write_hf_checkpoint(tmp_path, seed=3, num_hidden_layers=3)
    quantize_checkpoint(tmp_path, "int4", hf)
    events: list[str] = []
    join = PendingHostExperts.add_to

    def add_to(self, y):
        events.append("join")
        return join(self, y)

    monkeypatch.setattr(PendingHostExperts, "add_to", add_to)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=1, cpu_offload=6) as llm:
        shared = [
            m.shared_experts
            for m in llm.engine.model.modules()
            if getattr(m, "shared_experts", None) is not None and hasattr(m, "experts")
        ]
        assert len(shared) == 2  # layers 1 and 2 (layer 0 is dense)
        for m in shared:
            m.register_forward_pre_hook(lambda *_: events.append("shared"))
        llm.generate([[1, 2, 3, 4, 5]], params)
    assert events and events == ["shared", "join"] * (len(events) // 2), events
    assert len(events) == 2 * 2 * 3  # two layers, a prefill and two decode steps
