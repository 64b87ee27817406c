"""Tiny Kimi K3 checkpoints in the real K3 layout: the kimi_k3 wrapper config with the text model
in text_config (its quantization_config there too), tensors under language_model., vision tensors
beside them, MXFP4 routed experts (weight_packed / weight_scale U8), F32 conv / dt_bias / A_log [128]
/ o_norm / correction bias, everything else bf16. Written with safetensors directly (no engine code)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# the real K3 config's quantization block (text_config.quantization_config)
K3_QUANT = {
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": None,
            "targets": ["Linear"],
            "weights": {
                "group_size": 32,
                "num_bits": 4,
                "strategy": "group",
                "symmetric": True,
                "type": "float",
                "scale_dtype": "torch.uint8",
                "dynamic": False,
            },
        }
    },
    "format": "mxfp4-pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def k3_config(
    num_layers: int = 5,
    kda_layers=(1, 2, 4),
    full_attn_layers=(3, 5),
    quantized: bool = True,
    attn_res_block_size: int = 2,
    q_lora_rank: int | None = 24,
    kda_heads: int = 2,
    mla_heads: int = 2,
    num_experts: int = 8,
) -> dict:
    """A K3-shaped wrapper config, tiny: hidden 64, 2 KDA heads x 32, 2 MLA heads, 8 experts of
    width 32 at latent width 32 (MXFP4 needs multiples of 32), top-2 of 2 groups, 2 shared."""
    text = {
        "model_type": "kimi_linear",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": num_layers,
        "num_attention_heads": mla_heads,
        "num_key_value_heads": mla_heads,
        "vocab_size": 256,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": attn_res_block_size,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0,
        "num_experts": num_experts,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_expert_group": 2,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.5,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "linear_attn_config": {
            "num_heads": kda_heads,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "kda_layers": list(kda_layers),
            "full_attn_layers": list(full_attn_layers),
        },
    }
    if quantized:
        text["quantization_config"] = K3_QUANT
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "media_placeholder_token_id": 250,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k3_vision"},
    }


def _mxfp4(gen, out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    # random E2M1 codes (low nibble = even column), E8M0 scales 2^-4 .. 2^-2 per 32 columns
    packed = torch.randint(0, 256, (out_f, in_f // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    scale = torch.randint(123, 126, (out_f, in_f // 32), generator=gen, dtype=torch.int64).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": scale}


def k3_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, real K3 names and dtypes."""
    t = config["text_config"]
    gen = torch.Generator().manual_seed(seed)
    bf, f32 = torch.bfloat16, torch.float32
    d, v, n = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    la = t["linear_attn_config"]
    hk, dk, kk = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    p = hk * dk
    h = t["num_attention_heads"]
    qk, vd, r, rope = (
        t["qk_nope_head_dim"] + t["qk_rope_head_dim"],
        t["v_head_dim"],
        t["kv_lora_rank"],
        t["qk_rope_head_dim"],
    )
    lat, inter, e = t["routed_expert_hidden_size"], t["moe_intermediate_size"], t["num_experts"]
    quant = "quantization_config" in t

    def w(*shape, std=None, dtype=bf):
        std = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm(k, dtype=bf):
        return (1.0 + 0.2 * (torch.rand(k, generator=gen) - 0.5)).to(dtype)

    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": w(v, d, std=1.0),
        "lm_head.weight": w(v, d),
        "model.norm.weight": norm(d),
        "model.output_attn_res_norm.weight": norm(d),
        "model.output_attn_res_proj.weight": w(1, d),
    }
    for i in range(n):
        pre = f"model.layers.{i}."
        out |= {
            pre + "input_layernorm.weight": norm(d),
            pre + "post_attention_layernorm.weight": norm(d),
            pre + "self_attention_res_norm.weight": norm(d),
            pre + "mlp_res_norm.weight": norm(d),
            pre + "self_attention_res_proj.weight": w(1, d),
            pre + "mlp_res_proj.weight": w(1, d),
        }
        a = pre + "self_attn."
        if i + 1 in la["kda_layers"]:
            a_log = torch.zeros(128)
            a_log[:hk] = torch.rand(hk, generator=gen) * 2 - 1  # the tail stays zero padding, as in K3
            out |= {
                a + "q_proj.weight": w(p, d),
                a + "k_proj.weight": w(p, d),
                a + "v_proj.weight": w(p, d),
                a + "q_conv1d.weight": w(p, 1, kk, std=0.5, dtype=f32),
                a + "k_conv1d.weight": w(p, 1, kk, std=0.5, dtype=f32),
                a + "v_conv1d.weight": w(p, 1, kk, std=0.5, dtype=f32),
                a + "f_a_proj.weight": w(dk, d),
                a + "f_b_proj.weight": w(p, dk),
                a + "b_proj.weight": w(hk, d),
                a + "g_proj.weight": w(p, d),
                a + "A_log": a_log.to(f32),
                a + "dt_bias": w(p, std=1.0, dtype=f32),
                a + "o_norm.weight": norm(dk, f32),
                a + "o_proj.weight": w(d, p),
            }
        else:
            if t["q_lora_rank"]:
                q = t["q_lora_rank"]
                out |= {
                    a + "q_a_proj.weight": w(q, d),
                    a + "q_a_layernorm.weight": norm(q),
                    a + "q_b_proj.weight": w(h * qk, q),
                }
            else:
                out[a + "q_proj.weight"] = w(h * qk, d)
            out |= {
                a + "kv_a_proj_with_mqa.weight": w(r + rope, d),
                a + "kv_a_layernorm.weight": norm(r),
                a + "kv_b_proj.weight": w(h * (t["qk_nope_head_dim"] + vd), r),
                a + "g_proj.weight": w(h * vd, d),
                a + "o_proj.weight": w(d, h * vd),
            }
        if i < t["first_k_dense_replace"]:
            m = pre + "mlp."  # K3's dense layer: under mlp.
            out |= {
                m + "gate_proj.weight": w(t["intermediate_size"], d),
                m + "up_proj.weight": w(t["intermediate_size"], d),
                m + "down_proj.weight": w(d, t["intermediate_size"]),
            }
            continue
        m = pre + "block_sparse_moe."
        sh = inter * t["num_shared_experts"]
        out |= {
            m + "gate.weight": w(e, d),
            m + "gate.e_score_correction_bias": w(e, std=0.3, dtype=f32),
            m + "routed_expert_down_proj.weight": w(lat, d),
            m + "routed_expert_norm.weight": norm(lat),
            m + "routed_expert_up_proj.weight": w(d, lat),
            m + "shared_experts.gate_proj.weight": w(sh, d),
            m + "shared_experts.up_proj.weight": w(sh, d),
            m + "shared_experts.down_proj.weight": w(d, sh),
        }
        for x in range(e):
            for name, (o, k) in (("w1", (inter, lat)), ("w3", (inter, lat)), ("w2", (lat, inter))):
                base = f"{m}experts.{x}.{name}."
                if quant:
                    out |= {base + s: tt for s, tt in _mxfp4(gen, o, k).items()}
                else:
                    out[base + "weight"] = w(o, k)
    return out


def write_k3_checkpoint(path: Path, seed: int = 0, shards: int = 3, **config_kw) -> dict[str, torch.Tensor]:
    """Write config.json, the safetensors shards + index (text under language_model., plus vision
    tensors); returns the text tensors by their unprefixed names."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = k3_config(**config_kw)
    text = k3_tensors(config, seed)
    tensors = {f"language_model.{k}": v for k, v in text.items()}
    tensors["vision_tower.encoder.layers.0.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    tensors["mm_projector.proj.weight"] = torch.zeros(64, 8, dtype=torch.bfloat16)
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s * per : (s + 1) * per]
        save_file({k: tensors[k].contiguous() for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in part}
    total = sum(x.numel() * x.element_size() for x in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return text
