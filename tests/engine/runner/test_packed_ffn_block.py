"""The packed-expert FFN half in one Python call (kernels.cpu_packed_ffn_block) gives the bits of
the op-by-op layer: same tokens, same log-probs, same routing counts; and the bf16 RMSNorm's short
path equals the reference's."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels import reference
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

needs_ext = pytest.mark.skipif(
    not (cpu_few_rows.available() and cpu_quant_moe.available()), reason="C++ CPU kernels did not build here"
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def _run(path, prompts, packed: bool, dtype: str):
    llm = LLM(str(path), dtype=dtype, max_model_len=128, max_num_seqs=8, enable_prefix_caching=False)
    layers = llm.engine.runner.model.model.layers
    moe_layers = [layer for layer in layers if hasattr(layer.mlp, "experts")]
    assert moe_layers and all(layer.fused is not None and layer.fused.packed_ffn is not None for layer in moe_layers)
    calls = {"n": 0}
    for layer in moe_layers:
        if not packed:
            layer.fused.packed_ffn = None
            continue
        block = layer.fused.packed_ffn
        original = block.__call__

        class Counted:  # a wrapper counting the calls (instances' __call__ cannot be patched)
            def __init__(self, inner, run=original):
                self.inner, self.run = inner, run

            def fusable(self, x):
                return self.inner.fusable(x)

            def __call__(self, x):
                calls["n"] += 1
                return self.run(x)

        layer.fused.packed_ffn = Counted(block)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return (
        [o.outputs[0].token_ids for o in outs],
        [o.outputs[0].logprobs for o in outs],
        llm.engine.runner.model.routing_stats(),
        calls["n"],
    )


@needs_ext
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_ffn_block_matches_the_op_by_op_layer(tmp_path, dtype):
    hf = write_hf_checkpoint(tmp_path, seed=5, n_group=2, topk_group=1)
    quantize_checkpoint(tmp_path, "int4", hf)
    rng = random.Random(1)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 11, 29, 7)]
    tokens, logprobs, routing, calls = _run(tmp_path, prompts, True, dtype)
    ref_tokens, ref_logprobs, ref_routing, ref_calls = _run(tmp_path, prompts, False, dtype)
    assert calls >= 7 and ref_calls == 0  # it ran for the decode steps, and the reference never
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs  # exact: the same operations in the same order
    assert routing == ref_routing


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
