"""ModelConfig for kimi_linear and kimi_k3: K3's real config.json, transformers' spellings, and
clear errors for layouts we refuse to guess."""

from __future__ import annotations

import copy

import pytest

from kimitui.engine.config import ConfigError, ModelConfig
from tests.helpers.k3_checkpoint import k3_config

K3_LIST_FULL = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93]


def real_k3() -> dict:
    """Kimi K3's config.json (vision config reduced to its model_type) as published."""
    text = {
        "model_type": "kimi_linear",
        "hidden_size": 7168,
        "intermediate_size": 33792,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "vocab_size": 163840,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-05,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": 12,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "kda_layers": [i for i in range(1, 92) if i % 4],
            "full_attn_layers": K3_LIST_FULL,
        },
        "quantization_config": k3_config()["text_config"]["quantization_config"],
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k3_vision"},
    }


def test_real_k3_config():
    c = ModelConfig.from_dict(real_k3())
    assert c.model_type == "kimi_k3" and c.weight_prefix == "language_model."
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.n_group) == (896, 16, 2, 1)
    assert c.norm_topk_prob and c.scoring_func == "sigmoid" and c.max_position_embeddings == 1048576
    mla = [i for i in range(93) if not c.is_kda_layer(i)]
    assert len(mla) == 24 and mla[:2] == [3, 7] and mla[-2:] == [91, 92]  # the last two layers are both MLA
    assert c.is_kda_layer(0) and not c.is_moe_layer(0) and c.is_moe_layer(1) and c.is_moe_layer(92)
    assert (c.hidden_act, c.situ_beta, c.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert c.mla_use_nope and c.mla_use_output_gate and c.mla_norm_eps == 1e-6
    assert (c.attn_res_block_size, c.routed_expert_hidden_size, c.latent_moe_use_norm) == (12, 3584, True)
    assert c.linear_attn.gate_lower_bound == -5.0 and c.linear_attn.use_full_rank_gate
    assert c.quantization.method == "mxfp4" and c.quantization.group_size == 32  # found in text_config
    assert c.eos_token_ids == (163586,) and c.vision_model_type == "kimi_k3_vision"
    assert c.softmax_scale == pytest.approx(192**-0.5)  # NoPE: no mscale


def test_transformers_spellings_and_defaults():
    # what KimiLinearConfig.save_pretrained writes: model_max_length, num_experts, num_expert_group...
    raw = {
        "model_type": "kimi_linear",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "num_expert_group": 2,
        "topk_group": 1,
        "moe_renormalize": False,
        "model_max_length": 1048576,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-5,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    }
    c = ModelConfig.from_dict(raw)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.norm_topk_prob) == (8, 2, 2, False)
    assert c.layer_types == ("linear_attention", "full_attention", "linear_attention", "full_attention")
    assert c.hidden_act == "silu" and c.attn_res_block_size is None and c.routed_expert_hidden_size is None
    assert not c.mla_use_output_gate and c.linear_attn.gate_lower_bound is None and c.weight_prefix == ""


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t["linear_attn_config"].pop("kda_layers") and t["linear_attn_config"].pop("full_attn_layers"),
            "'linear_attn_config.kda_layers' and 'full_attn_layers' are missing",
        ),
        (lambda t: t["linear_attn_config"]["kda_layers"].remove(2), "layer 2 (1-indexed) is in neither"),
        (lambda t: t["linear_attn_config"]["kda_layers"].append(3), "layer 3 (1-indexed) is in both"),
        (lambda t: t["linear_attn_config"]["full_attn_layers"].append(6), "holds 6; layers are 1-indexed, 1..5"),
        (lambda t: t.update(hidden_act="gelu"), "field 'hidden_act' is 'gelu'"),
        (lambda t: t.update(mla_use_nope=False), "field 'mla_use_nope' is false"),
        (lambda t: t.pop("linear_attn_config"), "field 'linear_attn_config' is missing"),
        (lambda t: t.update(model_type="deepseek_v3"), "'text_config.model_type' is 'deepseek_v3'"),
    ],
)
def test_bad_configs_name_the_field(edit, message):
    raw = copy.deepcopy(k3_config())
    edit(raw["text_config"])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict(raw, source="ck/config.json")
