"""The fused CPU decode blocks (each half of a decoder layer as one C++ call) give the same bits as
the same layers run op by op: same tokens, same logprobs, same routing counts."""

from __future__ import annotations

import random

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from tests.helpers.checkpoints import write_hf_checkpoint

needs_ext = pytest.mark.skipif(not cpu_few_rows.available(), reason="C++ CPU kernels did not build here")
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def _run(path: str, prompts: list[list[int]], fused: bool, monkeypatch) -> tuple[list, list, dict]:
    llm = LLM(path, max_model_len=128, max_num_seqs=8, enable_prefix_caching=False)
    layers = llm.engine.runner.model.model.layers
    assert all(
        layer.fused is not None and layer.fused.attention_weights is not None and layer.fused.ffn_weights is not None
        for layer in layers
    )
    if not fused:
        for layer in layers:
            layer.fused = None
    calls = {"attention": 0, "ffn": 0}
    for name, key in (("attention_block", "attention"), ("ffn_block", "ffn")):
        original = getattr(cpu_few_rows, name)

        def counted(*args, _original=original, _key=key):
            calls[_key] += 1
            return _original(*args)

        monkeypatch.setattr(cpu_few_rows, name, counted)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    monkeypatch.undo()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]  # per step: {token id: logprob}
    return tokens, logprobs, {"calls": calls, "routing": llm.engine.runner.model.routing_stats()}


@needs_ext
@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}], ids=["q_lora", "q_proj"])
def test_fused_decode_blocks_match_the_op_by_op_layers(tmp_path, monkeypatch, overrides):
    write_hf_checkpoint(tmp_path, seed=5, n_group=2, topk_group=1, **overrides)
    rng = random.Random(1)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 11, 29, 7, 2)]
    fused_tokens, fused_logprobs, fused = _run(str(tmp_path), prompts, True, monkeypatch)
    tokens, logprobs, op_by_op = _run(str(tmp_path), prompts, False, monkeypatch)
    # The fused blocks ran for every decode step (3 layers a step), the op-by-op engine never.
    assert fused["calls"]["attention"] >= 3 * 9 and fused["calls"]["ffn"] >= 3 * 9
    assert op_by_op["calls"] == {"attention": 0, "ffn": 0}
    assert fused_tokens == tokens
    assert fused_logprobs == logprobs  # exact: the same kernels in the same order
    assert fused["routing"] == op_by_op["routing"]  # the fused MoE block counts its routing too
