"""Kimi K3's (latent) MoE in one C++ call on the CPU (``latent_moe_block``, kernels/cpu/packed_ffn_block.py
``LatentMoeWeights``) against the module op by op: same greedy tokens and routing counts in float32, log-probs
within rounding (bf16: the op-by-op module rounds after each product, the block once)."""

from __future__ import annotations

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.layers.latent_moe import KimiMoE
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from kimitui.kernels.cpu.packed_ffn_block import LatentMoeWeights
from tests.helpers.logprob_match import matching_logprobs

needs_ext = pytest.mark.skipif(
    not (cpu_few_rows.available() and cpu_quant_moe.available()), reason="C++ CPU kernels did not build here"
)
PROMPTS = [[5, 17, 3, 99, 41, 7, 63, 120, 8], [250, 2, 8, 120], [7, 7, 200, 41, 2]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    path = tmp_path_factory.mktemp("k3_latent_moe")
    write_k3_checkpoint(path, seed=4, num_layers=4, kda_layers=(1, 2), full_attn_layers=(3, 4))
    return path


def _run(path, dtype: str, fused: bool, monkeypatch):
    llm = LLM(str(path), dtype=dtype, max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)
    moes = [layer.mlp for layer in llm.engine.runner.model.model.layers if isinstance(layer.mlp, KimiMoE)]
    assert moes and all(isinstance(m.fused, LatentMoeWeights) for m in moes)
    if not fused:
        for m in moes:
            m.fused = None
    calls = {"n": 0}
    original = cpu_few_rows.latent_moe_block

    def counted(*args):
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(cpu_few_rows, "latent_moe_block", counted)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    monkeypatch.undo()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    routing = llm.engine.runner.model.routing_stats()
    return tokens, logprobs, routing, calls["n"]


@needs_ext
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_latent_moe_block_matches_the_module(ckpt, dtype, monkeypatch):
    tokens, logprobs, routing, calls = _run(ckpt, dtype, True, monkeypatch)
    ref_tokens, ref_logprobs, ref_routing, ref_calls = _run(ckpt, dtype, False, monkeypatch)
    assert calls >= 5 * 2 and ref_calls == 0  # the decode steps of each MoE layer went through it
    tol = 2e-3 if dtype == "float32" else 0.15
    compared = matching_logprobs(tokens, ref_tokens, logprobs, ref_logprobs, tol)
    assert compared >= 6
    if dtype == "float32":
        assert tokens == ref_tokens and routing == ref_routing
