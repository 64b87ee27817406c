"""FP8 block, INT4 pack-quantized and MXFP4 checkpoints (and the kimi_k25 wrapper) against
transformers running the dequantised weights: quantised storage must compute dequantise-then-matmul."""

from __future__ import annotations

import random

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.config import ModelConfig
from tests.helpers.checkpoints import hf_greedy, hf_prompt_logprobs, write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint


@pytest.mark.parametrize("method,wrap", [("fp8", False), ("int4", False), ("mxfp4", False), ("int4", True)])
def test_quantized_checkpoint_matches_dequantised_transformers(tmp_path, method, wrap):
    hf = write_hf_checkpoint(tmp_path, seed=3, n_group=2, topk_group=1)
    quantize_checkpoint(tmp_path, method, hf, wrap_k25=wrap)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.quantization.method == method
    assert cfg.weight_prefix == ("language_model." if wrap else "")
    llm = LLM(str(tmp_path), max_model_len=256, max_num_seqs=2)
    experts = llm.engine.model.model.layers[1].mlp.experts
    assert experts.fmt == method  # kept packed in memory, not expanded
    if wrap:
        assert llm.engine.load_report.tensors_skipped == 2  # vision tower + projector
    rng = random.Random(0)
    ids = [rng.randrange(320) for _ in range(150)]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ref = hf_prompt_logprobs(hf, ids)
    worst = max(abs(out.prompt_logprobs[i][ids[i]] - ref[i - 1, ids[i]].item()) for i in range(1, len(ids)))
    assert worst < 2e-3
    greedy = llm.generate({"prompt_token_ids": ids[:20]}, SamplingParams(temperature=0, max_tokens=12))[0]
    assert greedy.outputs[0].token_ids == hf_greedy(hf, ids[:20], 12)
