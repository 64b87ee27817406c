"""Kimi K3's attention layers' decode steps in one C++ call each on the CPU (kernels/cpu/k3_blocks.py:
the gated NoPE MLA through ``attention_block``, KDA through ``kda_block``) against the layers op by op:
same greedy tokens in float32 with log-probs within summation order, bf16 within rounding (the op-by-op
layers round after each product, the blocks once). The KDA block alone is also checked against
transformers in tests/engine/models/test_kda_layer.py."""

from __future__ import annotations

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import k3_decode as cpu_k3_decode
from kimitui.kernels.cpu.k3_blocks import KdaBlock, MlaBlock
from tests.helpers.logprob_match import matching_logprobs

needs_ext = pytest.mark.skipif(
    not (cpu_few_rows.available() and cpu_k3_decode.available()), reason="C++ CPU kernels did not build here"
)
PROMPTS = [[5, 17, 3, 99, 41, 7, 63, 120, 8], [250, 2, 8, 120], [7, 7, 200, 41, 2]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=[24, None], ids=["q_lora", "q_proj"])
def ckpt(request, tmp_path_factory):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    path = tmp_path_factory.mktemp("k3_attention_blocks")
    write_k3_checkpoint(
        path, seed=5, num_layers=4, kda_layers=(1, 2), full_attn_layers=(3, 4), q_lora_rank=request.param
    )
    return path


def _run(path, dtype: str, fused: bool, monkeypatch):
    llm = LLM(str(path), dtype=dtype, max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)
    attns = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    kinds = [type(a.fused) for a in attns]
    assert kinds == [KdaBlock, KdaBlock, MlaBlock, MlaBlock]
    if not fused:
        for a in attns:
            a.fused = None
    calls = {"attention_block": 0, "kda_block": 0}
    for name in calls:
        original = getattr(cpu_few_rows, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(cpu_few_rows, name, counted)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    monkeypatch.undo()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    return tokens, logprobs, calls


@needs_ext
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_blocks_match_the_layers(ckpt, dtype, monkeypatch):
    tokens, logprobs, calls = _run(ckpt, dtype, True, monkeypatch)
    ref_tokens, ref_logprobs, ref_calls = _run(ckpt, dtype, False, monkeypatch)
    # every decode step (5 of them, all three sequences at once) went through both layers of each kind
    assert calls["attention_block"] >= 5 * 2 and calls["kda_block"] >= 5 * 2
    assert ref_calls == {"attention_block": 0, "kda_block": 0}
    tol = 2e-3 if dtype == "float32" else 0.15
    compared = matching_logprobs(tokens, ref_tokens, logprobs, ref_logprobs, tol)
    assert compared >= 6
    if dtype == "float32":
        assert tokens == ref_tokens
