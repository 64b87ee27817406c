"""INT4 and MXFP4 checkpoints with most experts in host RAM (``cpu_offload``) run those experts through
the packed-weight C++ kernels and give the tokens of a run without offload and of transformers on the
dequantised weights."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from tests.helpers.checkpoints import hf_greedy, write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

pytestmark = pytest.mark.skipif(not cpu_quant_moe.available(), reason="the C++ extension does not build here")

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)


@pytest.mark.parametrize("method", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offloaded_packed_experts_give_the_same_tokens(tmp_path, monkeypatch, method, dtype):
    hf = write_hf_checkpoint(tmp_path, seed=7, n_group=2, topk_group=1, num_hidden_layers=2)
    quantize_checkpoint(tmp_path, method, hf)
    rng = random.Random(2)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (6, 40)]
    calls = []
    real = cpu_quant_moe.moe
    monkeypatch.setattr(cpu_quant_moe, "moe", lambda *a, **k: calls.append(a[3]) or real(*a, **k))

    with LLM(str(tmp_path), dtype=dtype, max_model_len=128, max_num_seqs=2, cpu_offload="none") as llm:
        experts = llm.engine.model.model.layers[1].mlp.experts
        local = experts.local  # packed, as the kernels' tiles, no dequantised copy and no checkpoint copy
        assert experts.host is None and (local.fmt, local.tiled_fmt) == ("tiles", method)
        assert local.w13_tiles.dtype == torch.uint8 and local.w13_weight_packed.numel() == 0
        plain = llm.generate(prompts, PARAMS)
    n_experts = llm.engine.config.n_routed_experts
    with LLM(str(tmp_path), dtype=dtype, max_model_len=128, max_num_seqs=2, cpu_offload=n_experts - 2) as llm:
        host = llm.engine.model.model.layers[1].mlp.experts.host
        assert host is not None and host.num == n_experts - 2 and (host.fmt, host.tiled_fmt) == ("tiles", method)
        assert host.w13_tiles.device.type == "cpu" and host.w13_tiles.shape[0] == host.num
        calls.clear()
        offloaded = llm.generate(prompts, PARAMS)
    assert calls and set(calls) == {method}  # the host experts went through the C++ kernels
    for a, b in zip(plain, offloaded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for i in range(1, len(a.prompt_logprobs)):
            for tok, lp in a.prompt_logprobs[i].items():
                assert abs(b.prompt_logprobs[i][tok] - lp) < (1e-4 if dtype == "float32" else 5e-2)
    if dtype == "float32":  # a CPU-only run gives the oracle's greedy tokens
        assert plain[0].outputs[0].token_ids == hf_greedy(hf, prompts[0], 8)


def test_bf16_int4_experts_take_the_tile_layout(tmp_path):
    hf = write_hf_checkpoint(tmp_path, seed=8, num_hidden_layers=2)
    quantize_checkpoint(tmp_path, "int4", hf)
    with LLM(str(tmp_path), dtype="bfloat16", max_model_len=64, max_num_seqs=1) as llm:
        stack = llm.engine.model.model.layers[1].mlp.experts.local
        assert stack.ops.quant_experts_native("int4", llm.engine.config.hidden_size, stack.inter, 32)
        # not converted to torch's int4pack layout: the C++ kernels stream their tiles of the same words
        assert stack.fmt == "tiles" and stack.tiled_fmt == "int4" and stack.w13_tiles.dtype == torch.uint8
