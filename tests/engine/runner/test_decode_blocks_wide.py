"""A bf16 decode step wider than the few-row kernels' 16 rows: on a CPU where oneDNN has a native
bf16 product it runs the fused C++ decode blocks (oneDNN products on packed weights, MLA batched
over the step's sequences), checked here against the same model's op-by-op bf16 layers, within
bf16 rounding; and which row counts the blocks take."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu.decode_block import block_rows
from kimitui.kernels.cpu.linear import onednn_bf16_native
from tests.helpers.checkpoints import write_hf_checkpoint

needs_wide = pytest.mark.skipif(
    not (cpu_few_rows.available() and onednn_bf16_native()),
    reason="C++ CPU kernels did not build here, or oneDNN has no native bf16 product on this CPU",
)
SEQS = 24  # past MAX_ROWS (16), within MAX_BF16_BLOCK_ROWS


def _generate(llm, prompts: list[list[int]], monkeypatch):
    widths = {"attention_block": [], "ffn_block": []}
    for name in widths:
        original = getattr(cpu_few_rows, name)

        def counted(x, *args, _original=original, _seen=widths[name]):
            _seen.append(x.shape[0])
            return _original(x, *args)

        monkeypatch.setattr(cpu_few_rows, name, counted)
    before = llm.engine.runner.model.routing_stats()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    monkeypatch.undo()
    after = llm.engine.runner.model.routing_stats()
    routed = sum(sum(after[i]) - sum(before[i]) for i in after)
    return outs, widths, routed


@needs_wide
def test_wide_bf16_decode_blocks_match_the_op_by_op_bf16_layers(tmp_path, monkeypatch):
    write_hf_checkpoint(tmp_path, seed=11, n_group=2, topk_group=1)
    rng = random.Random(5)
    prompts = [[rng.randrange(320) for _ in range(rng.randrange(2, 30))] for _ in range(SEQS)]
    # one engine (one load), run with its fused layers, then with them taken away (op by op)
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=96, max_num_seqs=SEQS, enable_prefix_caching=False)
    layers = llm.engine.runner.model.model.layers
    fused = [layer.fused for layer in layers]
    assert all(f is not None and f.attention_weights is not None and f.ffn_weights is not None for f in fused)
    wide, widths, wide_routed = _generate(llm, prompts, monkeypatch)
    for layer in layers:
        layer.fused = None
    plain, plain_widths, plain_routed = _generate(llm, prompts, monkeypatch)
    for seen in widths.values():  # the wide steps ran in both blocks
        assert SEQS in seen and max(seen) > cpu_few_rows.MAX_ROWS
    assert plain_widths == {"attention_block": [], "ffn_block": []}
    compared = 0
    for a, b in zip(wide, plain):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        for step in range(len(ta)):
            if ta[:step] != tb[:step]:
                break
            common = set(la[step]) & set(lb[step])
            assert len(common) >= 3
            for tok in common:
                assert abs(la[step][tok] - lb[step][tok]) < 0.1, (step, tok, la[step][tok], lb[step][tok])
            compared += step > 0
    assert compared >= SEQS  # decode steps actually compared
    # every row's routing counted once by either path (the fused MoE block counts its own)
    assert wide_routed == plain_routed > 0


def test_block_rows_takes_wide_steps_only_for_bf16_with_native_onednn():
    d = 8
    for rows in (1, cpu_few_rows.MAX_ROWS):
        assert block_rows(torch.zeros(rows, d)) and block_rows(torch.zeros(rows, d, dtype=torch.bfloat16))
    assert not block_rows(torch.zeros(0, d))
    wide = cpu_few_rows.MAX_ROWS + 1
    assert not block_rows(torch.zeros(wide, d))  # float32: the widening loops lose to BLAS there
    assert block_rows(torch.zeros(wide, d, dtype=torch.bfloat16)) == onednn_bf16_native()
    assert not block_rows(torch.zeros(cpu_few_rows.MAX_BF16_BLOCK_ROWS + 1, d, dtype=torch.bfloat16))
