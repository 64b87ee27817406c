"""Our Kimi Linear model against transformers' KimiLinearForCausalLM on checkpoints it wrote.

The checkpoints come from transformers' own save_pretrained (its config spellings: num_experts,
num_experts_per_token, num_expert_group, moe_renormalize, model_max_length; the MoE under
block_sparse_moe. with experts.E.w1/w2/w3), so the config and the names are not ours.
"""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from tests.helpers.hybrid_driver import HybridDriver

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    first_k_dense_replace=1,
    model_max_length=1024,
)


def _lac(kda: list[int], full: list[int]) -> dict:
    return {"kda_layers": kda, "full_attn_layers": full, "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4}


CASES = {
    # q-LoRA on, 2 expert groups keeping 1, 2 shared experts; KDA and MLA interleaved, listed out of order
    "qlora_groups": dict(
        q_lora_rank=24,
        n_group=2,
        topk_group=1,
        n_shared_experts=2,
        num_hidden_layers=5,
        linear_attn_config=_lac([5, 1, 2, 4], [3]),
    ),
    # q-LoRA off, one group, last two layers MLA (as in K3)
    "no_qlora": dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        num_hidden_layers=4,
        linear_attn_config=_lac([1, 2], [3, 4]),
    ),
}
# MLA-only variants run without the KDA layer (engine.layers.kda, another branch) present
MLA_ONLY = {
    "mla_only_qlora": dict(
        q_lora_rank=24,
        n_group=2,
        topk_group=1,
        n_shared_experts=2,
        num_hidden_layers=3,
        linear_attn_config=_lac([], [1, 2, 3]),
    ),
}


def _has_kda() -> bool:
    try:
        import kimitui.engine.layers.kda  # noqa: F401
    except ImportError:
        return False
    return True


def hf_kimi_linear(seed: int, **overrides):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(**{**BASE, **overrides}, attn_implementation="eager")
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                t.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                t.uniform_(0.8, 1.2)  # not all ones, so a missed norm weight shows
            elif name.endswith("dt_bias"):
                t.normal_(0, 1.0)
            elif name.endswith("A_log"):
                t.uniform_(-1.0, 1.0)
    return model


def _params():
    out = [pytest.param(k, id=k) for k in sorted(MLA_ONLY)]
    for k in sorted(CASES):
        out.append(
            pytest.param(
                k, id=k, marks=pytest.mark.skipif(not _has_kda(), reason="kimitui.engine.layers.kda not merged")
            )
        )
    return out


@pytest.fixture(scope="module", params=_params())
def oracle(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_kimi_linear(1, **{**CASES, **MLA_ONLY}[request.param])
    hf.save_pretrained(str(path))
    return hf, HybridDriver(path, max_seqs=4, max_len=400), path


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _hf_greedy(hf, ids, n):
    # transformers' own cached decode (its KDA recurrent path and latent MLA cache), plain argmax:
    # generate(min_new_tokens=...) would mask EOS, which our greedy loop may pick
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        toks = []
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[toks[-1]]]), cache=out.past_key_values, use_cache=True)
    return toks


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def test_loads_transformers_checkpoint(oracle):
    hf, drv, _ = oracle
    assert drv.report.tensors_skipped == 0
    # the layer order is the config's 1-indexed lists, not a formula
    assert [("kda" if layer.is_kda else "mla") for layer in drv.model.model.layers] == [
        "kda" if t == "linear_attention" else "mla" for t in hf.config.layer_types
    ]


@pytest.mark.parametrize("budget", [None, 37])
def test_prompt_logprobs_batched_and_chunked(oracle, budget):
    # 150 tokens: over two 64-token KDA chunks; two prompts in one batch; budget 37 splits both
    hf, drv, _ = oracle
    prompts = _prompts(0, (150, 71))
    ours = drv.prompt_logprobs(prompts, budget)
    for ids, lp in zip(prompts, ours):
        ref = _hf_logprobs(hf, ids)
        assert (lp - ref).abs().max().item() < 2e-3


def test_greedy_continuations_match_transformers(oracle):
    hf, drv, _ = oracle
    prompts = _prompts(1, (7, 130))
    outs = drv.greedy(prompts, 16, budget=50)
    for ids, out in zip(prompts, outs):
        assert out == _hf_greedy(hf, ids, 16)


def test_decode_equals_prefill_of_same_tokens(oracle):
    _, drv, _ = oracle
    prompt = _prompts(2, (70,))[0]
    cont = drv.greedy([prompt], 12)[0]
    full = drv.prompt_logprobs([prompt + cont])[0]
    # prefill of prompt + continuation predicts the same greedy tokens
    assert full[len(prompt) - 1 : -1].argmax(-1).tolist() == cont


def test_llm_end_to_end_matches_transformers(oracle):
    # through LLM(): scheduler state slots, runner metadata, cache pool with KDA state and MLA pages
    hf, _, path = oracle
    prompts = _prompts(3, (9, 140))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    with LLM(str(path), max_model_len=400, max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for ids, out in zip(prompts, outs):
        ref = _hf_logprobs(hf, ids)
        worst = max(abs(out.prompt_logprobs[i][ids[i]] - ref[i - 1, ids[i]].item()) for i in range(1, len(ids)))
        assert worst < 2e-3
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, 10)
