"""The packed-expert FFN half (kernels.cpu.packed_ffn_block) against the op-by-op layer: the C++ block
(``packed_ffn_block``: float32 inside, rounded once) within rounding, the Python block bit for bit
(same tokens, same log-probs, same routing counts); and the bf16 RMSNorm's short path equals the
reference's."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels import reference
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from kimitui.kernels.cpu.packed_ffn_block import PackedFfnBlock, PackedFfnWeights
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

needs_ext = pytest.mark.skipif(
    not (cpu_few_rows.available() and cpu_quant_moe.available()), reason="C++ CPU kernels did not build here"
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def _run(path, prompts, mode: str, dtype: str, monkeypatch):
    """mode "cxx": the C++ block; "python": the one-call Python block; "ops": the layer op by op."""
    llm = LLM(str(path), dtype=dtype, max_model_len=128, max_num_seqs=8, enable_prefix_caching=False)
    layers = llm.engine.runner.model.model.layers
    moe_layers = [layer for layer in layers if hasattr(layer.mlp, "experts")]
    assert moe_layers and all(isinstance(layer.fused.ffn_weights, PackedFfnWeights) for layer in moe_layers)
    calls = {"n": 0}
    for layer in moe_layers:
        fused = layer.fused
        if mode != "cxx":
            fused.ffn_weights = None
        if mode != "python":
            continue
        block = PackedFfnBlock.build(layer.post_attention_layernorm, layer.mlp, fused.backend)

        class Counted:  # a wrapper counting the calls (instances' __call__ cannot be patched)
            def __init__(self, inner):
                self.inner = inner

            def fusable(self, x):
                return self.inner.fusable(x)

            def __call__(self, x):
                calls["n"] += 1
                return self.inner(x)

        fused.packed_ffn = Counted(block)
    original = cpu_few_rows.packed_ffn_block

    def counted(*args):
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(cpu_few_rows, "packed_ffn_block", counted)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    monkeypatch.undo()
    return (
        [o.outputs[0].token_ids for o in outs],
        [o.outputs[0].logprobs for o in outs],
        llm.engine.runner.model.routing_stats(),
        calls["n"],
    )


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("int4")
    hf = write_hf_checkpoint(path, seed=5, n_group=2, topk_group=1)
    quantize_checkpoint(path, "int4", hf)
    return path


PROMPTS = [[random.Random(1).randrange(320) for _ in range(n)] for n in (3, 11, 29, 7)]


@needs_ext
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_python_packed_ffn_block_is_the_op_by_op_layer(int4_checkpoint, dtype, monkeypatch):
    tokens, logprobs, routing, calls = _run(int4_checkpoint, PROMPTS, "python", dtype, monkeypatch)
    ref_tokens, ref_logprobs, ref_routing, ref_calls = _run(int4_checkpoint, PROMPTS, "ops", dtype, monkeypatch)
    assert calls >= 7 and ref_calls == 0  # it ran for the decode steps, and the reference never
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs  # exact: the same operations in the same order
    assert routing == ref_routing


@needs_ext
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cxx_packed_ffn_block_matches_the_op_by_op_layer(int4_checkpoint, dtype, monkeypatch):
    tokens, logprobs, routing, calls = _run(int4_checkpoint, PROMPTS, "cxx", dtype, monkeypatch)
    ref_tokens, ref_logprobs, ref_routing, ref_calls = _run(int4_checkpoint, PROMPTS, "ops", dtype, monkeypatch)
    assert calls >= 7 and ref_calls == 0
    tol = 1e-4 if dtype == "float32" else 0.1  # bf16: the op-by-op layer rounds after every operation
    compared = 0
    for ta, tb, la, lb in zip(tokens, ref_tokens, logprobs, ref_logprobs):
        for step in range(len(ta)):
            if ta[:step] != tb[:step]:  # compared while both have the same history (near-ties may part them)
                break
            common = set(la[step]) & set(lb[step])
            assert len(common) >= 2
            for tok in common:
                assert abs(la[step][tok] - lb[step][tok]) < tol, (step, tok, la[step][tok], lb[step][tok])
            compared += step > 0
    assert compared >= 8
    if dtype == "float32":
        assert tokens == ref_tokens and routing == ref_routing


def test_bf16_rms_norm_short_path_is_the_reference():
    from kimitui.kernels.cpu.backend import CpuBackend

    backend = CpuBackend()
    g = torch.Generator().manual_seed(0)
    for rows, d, scale in ((1, 1280, 1.0), (3, 7168, 30.0), (16, 64, 1e-3), (5, 320, 1e4)):
        x = (torch.randn(rows, d, generator=g) * scale).bfloat16()
        w = (torch.rand(d, generator=g) * 2).bfloat16()
        got = backend.rms_norm(x, w, 1e-6)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, reference.rms_norm(x, w, 1e-6))
