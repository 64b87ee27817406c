"""The built-in demo checkpoint: a small random-weight Kimi K2-shaped model.

It is written on first use into the XDG cache dir, byte-for-byte the same every time (fixed seed,
fixed tokenizer training text), in exactly the layout of a real Kimi K2 checkpoint: config.json
with ``model_type`` ``kimi_k2``, bf16 safetensors shards with ``model.safetensors.index.json``,
``tiktoken.model`` and ``tokenizer_config.json`` with Kimi's special tokens. It goes through the
same loader and engine as a real checkpoint. Its weights are random: its output is noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kimitui.engine.demo.bpe_train import demo_corpus, train_ranks, write_kimi_tokenizer_files
from kimitui.engine.demo.common import (
    NUM_BASE_TOKENS,
    SEED,
    ensure_checkpoint,
    mla_low_rank_shapes,
    swiglu_shapes,
    write_shards,
)
from kimitui.engine.paths import cache_root

DEMO_VERSION = 1

# K2's field set (reference: Kimi-K2-Instruct config.json), dimensions shrunk to decode fast on a laptop.
DEMO_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "_name_or_path": "kimitui-demo",
    "kimitui_demo": True,
    "kimitui_demo_note": "random weights: output is noise. Built into kimitui to show every part working.",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 32,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "seq_aux": True,
    "aux_loss_alpha": 0.001,
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
    "vocab_size": NUM_BASE_TOKENS + 256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": NUM_BASE_TOKENS,
    "eos_token_id": NUM_BASE_TOKENS + 1,
    "num_nextn_predict_layers": 0,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
}


def demo_dir() -> Path:
    return cache_root() / f"demo-v{DEMO_VERSION}"


def ensure_demo_checkpoint(path: str | Path | None = None) -> Path:
    """The K2 demo checkpoint directory, written first if it is not there yet."""
    return ensure_checkpoint(Path(path) if path is not None else demo_dir(), write_demo_checkpoint)


def write_demo_checkpoint(path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = _random_weights(DEMO_CONFIG)
    write_shards(path, tensors)
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": NUM_BASE_TOKENS,
                "eos_token_id": [NUM_BASE_TOKENS + 1, NUM_BASE_TOKENS + 2],
                "max_length": DEMO_CONFIG["max_position_embeddings"],
            },
            indent=2,
        )
        + "\n"
    )
    write_kimi_tokenizer_files(
        path, train_ranks(demo_corpus(), NUM_BASE_TOKENS), model_max_length=DEMO_CONFIG["max_position_embeddings"]
    )


def _random_weights(c: dict) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors, drawn in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(SEED)
    d, std = c["hidden_size"], c["initializer_range"]
    h, v = c["num_attention_heads"], c["v_head_dim"]
    out: dict[str, torch.Tensor] = {}

    def normal(name: str, *shape: int, scale: float = std) -> None:
        out[name] = (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    def ones(name: str, n: int) -> None:
        out[name] = torch.ones(n, dtype=torch.bfloat16)

    normal("model.embed_tokens.weight", c["vocab_size"], d, scale=1.0)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        ones(f"{p}.input_layernorm.weight", d)
        ones(f"{p}.post_attention_layernorm.weight", d)
        a = f"{p}.self_attn"
        for name, shape in mla_low_rank_shapes(c):
            (ones if len(shape) == 1 else normal)(f"{a}.{name}.weight", *shape)
        normal(f"{a}.o_proj.weight", d, h * v)
        m = f"{p}.mlp"
        if i < c["first_k_dense_replace"]:
            for proj, shape in swiglu_shapes(c["intermediate_size"], d):
                normal(f"{m}.{proj}.weight", *shape)
            continue
        inter = c["moe_intermediate_size"]
        normal(f"{m}.gate.weight", c["n_routed_experts"], d)
        out[f"{m}.gate.e_score_correction_bias"] = torch.zeros(c["n_routed_experts"], dtype=torch.float32)
        for e in range(c["n_routed_experts"]):
            for proj, shape in swiglu_shapes(inter, d):
                normal(f"{m}.experts.{e}.{proj}.weight", *shape)
        for proj, shape in swiglu_shapes(inter * c["n_shared_experts"], d):
            normal(f"{m}.shared_experts.{proj}.weight", *shape)
        # The real K2 checkpoint carries unused rotary buffers; keep one so the loader's skip path runs.
    out["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(c["qk_rope_head_dim"] // 2, dtype=torch.bfloat16)
    ones("model.norm.weight", d)
    normal("lm_head.weight", c["vocab_size"], d)
    return out
