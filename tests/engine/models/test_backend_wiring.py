"""A model's backend is chosen once at load, from the settings of that moment, and reaches every
layer; the CPU expert executor owns its worker thread."""

from __future__ import annotations

import threading

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.layers.moe import ExpertStack
from kimitui.engine.offload.cpu_experts import CpuExpertExecutor
from kimitui.kernels.backend import REFERENCE, Backend
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu.backend import CpuBackend
from tests.helpers.checkpoints import write_hf_checkpoint


def _backends(llm) -> set:
    model = llm.engine.model
    return {id(m.ops) for m in model.modules() if isinstance(getattr(m, "ops", None), Backend)}


def test_the_backend_is_chosen_at_load_and_fixed(tmp_path, monkeypatch):
    write_hf_checkpoint(tmp_path, seed=3, num_hidden_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": [5, 17, 3, 99]}
    monkeypatch.setenv("KIMITUI_KERNELS", "reference")
    ref_llm = LLM(str(tmp_path), max_model_len=64, max_num_seqs=2, enable_prefix_caching=False)
    layers = ref_llm.engine.model.model.layers
    assert _backends(ref_llm) == {id(REFERENCE)}
    assert all(layer.fused is None for layer in layers)
    monkeypatch.delenv("KIMITUI_KERNELS")  # read at load only: the loaded model keeps the reference
    want = ref_llm.generate(prompt, params)[0].outputs[0]
    assert _backends(ref_llm) == {id(REFERENCE)}

    llm = LLM(str(tmp_path), max_model_len=64, max_num_seqs=2, enable_prefix_caching=False)
    (ops_id,) = _backends(llm)  # one object for every layer
    ops = llm.engine.model.model.layers[0].self_attn.ops
    assert id(ops) == ops_id and isinstance(ops, CpuBackend)
    assert all((layer.fused is not None) == cpu_few_rows.available() for layer in llm.engine.model.model.layers)
    got = llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    for a, b, t in zip(got.logprobs, want.logprobs, got.token_ids):
        assert abs(a[t] - b[t]) < 1e-4


class _DoublingStack:
    num = 2
    run_subset = ExpertStack.run_subset  # the executor's call into a stack

    def __call__(self, x, ids, weights):
        return x * 2


def test_the_expert_executor_owns_its_worker_thread():
    def workers():
        return {t for t in threading.enumerate() if t.name.startswith("kimitui-cpu-experts")}

    before = workers()
    executor = CpuExpertExecutor(_DoublingStack(), torch.tensor([0, 1, -1]))
    assert workers() == before  # nothing starts until the first submit
    x = torch.ones(2, 4)
    y = executor.submit(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)).result()
    assert torch.equal(y, x * 2)
    mine = workers() - before
    assert len(mine) == 1
    executor.shutdown()
    assert not any(t.is_alive() for t in mine)
    with pytest.raises(RuntimeError):
        executor.submit(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))
