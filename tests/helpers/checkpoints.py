"""Tiny DeepSeek-V3 / Kimi K2 checkpoints written by transformers, for oracle tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


def hf_model(seed: int = 0, bias_std: float = 0.5, **overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**BASE, **overrides}, attn_implementation="eager")
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                t.normal_(0, bias_std)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                t.uniform_(0.8, 1.2)  # not all ones, so a missed norm weight shows
    return model


def write_hf_checkpoint(path: Path, seed: int = 0, **overrides):
    """Save a random tiny model with transformers' own save_pretrained; returns the HF model."""
    model = hf_model(seed, **overrides)
    model.save_pretrained(str(path))
    return model


def state_dict_from(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rewrite_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 2) -> None:
    """Write ``tensors`` as a sharded checkpoint with an index, and ``config`` as config.json."""
    from safetensors.torch import save_file

    for f in path.glob("*.safetensors*"):
        f.unlink()
    names = sorted(tensors)
    weight_map = {}
    per = -(-len(names) // shards)
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()
