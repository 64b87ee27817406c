"""INT4 experts held by a CPU with bf16 activations run through torch's CPU int4 GEMM."""

from __future__ import annotations

import random

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels.cpu import moe as cpu_moe
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

pytestmark = pytest.mark.skipif(
    not cpu_moe.int4pack_cpu_supported(64, 64, 32), reason="this torch has no CPU int4 GEMM"
)


def _run(path, prompt):
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=2)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return llm, [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]


def test_bf16_int4_experts_use_the_cpu_int4_gemm_and_match_dequantising(tmp_path, monkeypatch):
    from kimitui.kernels.cpu.backend import CpuBackend

    # kernels.cpu_quant_moe takes these stacks where it builds; this test is about the int4pack fallback
    monkeypatch.setattr(CpuBackend, "quant_cxx", False)
    hf = write_hf_checkpoint(tmp_path, seed=5, num_hidden_layers=2)
    quantize_checkpoint(tmp_path, "int4", hf)
    prompt = [random.Random(1).randrange(320) for _ in range(60)]
    llm, packed = _run(tmp_path, prompt)
    stack = llm.engine.model.model.layers[1].mlp.experts.local
    assert stack.fmt == "int4pack"
    assert stack.w13_weight_packed.numel() == 0  # the checkpoint layout is not kept beside it
    monkeypatch.setattr(cpu_moe, "int4pack_cpu_supported", lambda *a: False)
    llm, dequantised = _run(tmp_path, prompt)
    assert llm.engine.model.model.layers[1].mlp.experts.local.fmt == "int4"
    # Same weights, same bf16 activations; only the accumulation order differs (measured 5e-7). A
    # wrong nibble order or scale layout moves log-probs by whole units.
    assert max(abs(a - b) for a, b in zip(packed, dequantised)) < 1e-2
