"""Our engine against Hugging Face transformers' DeepseekV3ForCausalLM on checkpoints it wrote."""

from __future__ import annotations

import random

import pytest

from kimitui.engine import LLM, SamplingParams
from tests.helpers.checkpoints import hf_greedy, hf_prompt_logprobs, write_hf_checkpoint

CASES = {
    # q-LoRA, group-limited routing (4 groups, keep 2), renormalised, biased, 2 dense layers, 2 shared experts
    "qlora_groups": dict(
        q_lora_rank=32,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        first_k_dense_replace=2,
        n_shared_experts=2,
        num_hidden_layers=4,
    ),
    # no q-LoRA (plain q_proj), no renormalisation, one group, one dense layer, Kimi-style beta 1/1
    "no_qlora": dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=1,
        n_shared_experts=1,
        rope_scaling={
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def oracle(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = write_hf_checkpoint(path, seed=1, **CASES[request.param])
    llm = LLM(str(path), max_model_len=512, max_num_seqs=4)
    return hf, llm


def test_prompt_logprobs_match_transformers(oracle):
    hf, llm = oracle
    rng = random.Random(0)
    # 300 tokens: over 4x original_max_position_embeddings (64), so YaRN's ramp matters
    ids = [rng.randrange(320) for _ in range(300)]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    ref = hf_prompt_logprobs(hf, ids)
    assert out.prompt_logprobs[0] is None
    worst = 0.0
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert ids[i] in entry
        for tok, lp in entry.items():
            worst = max(worst, abs(lp - ref[i - 1, tok].item()))
        top = ref[i - 1].topk(5).indices.tolist()
        assert set(top) <= set(entry)  # the top-5 are the model's top-5
    assert worst < 2e-3


def test_greedy_continuations_match_transformers(oracle):
    hf, llm = oracle
    rng = random.Random(1)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (7, 64, 290)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 24)
        assert out.outputs[0].finish_reason == "length"
