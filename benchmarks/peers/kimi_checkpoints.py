"""The side-by-side benchmarks' Kimi-shaped checkpoints, random weights in Kimi's on-disk formats:
K2-shaped (DeepSeek-V3 architecture, bf16 or with compressed-tensors INT4 routed experts) and
K3-shaped (demo-k3's layout scaled up, MXFP4 routed experts). See ``vs_llama_cpp.py``'s docstring."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 1280,
    "intermediate_size": 3328,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 48,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 8.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "vocab_size": 4096 + 256,
    "bos_token_id": 4096,
    "eos_token_id": 4097,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "num_nextn_predict_layers": 0,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}
K3_TEXT = {  # demo-k3's text_config, scaled up (filled in from kimitui.engine.demo.k3.TEXT_CONFIG)
    "hidden_size": 1280,
    "intermediate_size": 3328,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "routed_expert_hidden_size": 640,
    "num_experts": 48,
    "num_experts_per_token": 6,
    "moe_intermediate_size": 768,
    "linear_attn_config": {
        "num_heads": 8,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
    },
}
CASES = ("k2-bf16", "k2-int4", "k3-mxfp4")


def write_k2(path: Path, int4: bool) -> None:
    """The K2-shaped checkpoint (the demo's writer and tokenizer at K2_CONFIG); with ``int4`` the
    routed experts of the bf16 file quantized to compressed-tensors pack-quantized INT4."""
    if (path / "config.json").is_file():
        return
    sys.path.insert(0, str(ROOT))
    from kimitui.engine.demo import _random_weights, ensure_demo_checkpoint, write_shards
    from kimitui.kernels import reference as R

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = _random_weights(K2_CONFIG)
    config = dict(K2_CONFIG)
    if int4:
        expert = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
        for name in [n for n in tensors if expert.search(n)]:
            w = tensors.pop(name)
            packed, scale = R.quantize_int4(w, 32)
            base = name[: -len(".weight")]
            tensors[f"{base}.weight_packed"], tensors[f"{base}.weight_scale"] = packed, scale
            tensors[f"{base}.weight_shape"] = torch_tensor(list(w.shape))
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": 32,
            "dynamic": False,
            "observer": "minmax",
            "actorder": None,
        }
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "input_activations": None,
                    "output_activations": None,
                    "weights": weights,
                }
            },
            "ignore": [
                "lm_head",
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            ],
            "kv_cache_scheme": None,
        }
    write_shards(tmp, tensors)
    demo = ensure_demo_checkpoint()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(demo / name, tmp / name)
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": K2_CONFIG["bos_token_id"], "eos_token_id": K2_CONFIG["eos_token_id"]}) + "\n"
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(path)


def torch_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.int32)


def write_k3(path: Path) -> None:
    """The K3-shaped checkpoint: demo-k3's writer, config and tokenizer at the K3_TEXT dimensions."""
    if (path / "config.json").is_file():
        return
    sys.path.insert(0, str(ROOT))
    from kimitui.engine.demo import k3 as demo_k3
    from kimitui.engine.demo import write_shards

    text = dict(demo_k3.TEXT_CONFIG, **K3_TEXT)
    text.pop("kimitui_demo", None)
    config = dict(demo_k3.DEMO_K3_CONFIG, text_config=text, _name_or_path="kimitui-bench-k3")
    for key in ("kimitui_demo", "kimitui_demo_note"):
        config.pop(key, None)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_shards(tmp, demo_k3._random_weights(text))
    demo = demo_k3.ensure_demo_k3_checkpoint()
    for name in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(path)
