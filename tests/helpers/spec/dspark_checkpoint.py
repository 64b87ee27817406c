"""Tiny DSpark drafter checkpoints in the published layouts, for a given K3 / Kimi Linear target.

- ``lightseek``: lightseekorg/kimi-k3-dspark (TorchSpec export): config keys as published
  (``K3DSparkModel`` / ``k3_dspark``, ``target_layer_ids``, ``fc_norm: true``, ``aux_hidden_stream:
  "attn_res"``, ``mask_token_id``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov``, ``rope_parameters`` YaRN...), tensors ``context_proj``,
  ``context_norm``, ``fc_norm.<i>``, ``embed_tokens`` (a copy of the target's, as the 7.12 GB file
  holds), ``layers.<l>.*`` (MLA with q/kv LoRA, gated MLP), ``final_norm``,
  ``markov_head.markov_w{1,2}``, ``confidence_head.proj.{weight,bias}``; no ``lm_head``.
- ``inferact``: Inferact/Kimi-K3.1-Pro-DSpark-preview. Its config.json could not be read; the model
  card says 5 dense MLA layers (96 heads, q/kv LoRA 1536/512), FFN 14336, Markov rank 512, a
  confidence head, embedding and LM head shared with the target, YaRN factor 32. The key set is the
  closest public definition, Inferact/Kimi-K3-DSpark's (no ``fc_norm`` / ``aux_hidden_stream``: the
  ``prefix`` stream), with no ``embed_tokens`` tensor.

Written with safetensors directly (no engine code). Shapes shrink with the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LAYOUTS = ("lightseek", "inferact")


def dspark_config(
    target_text: dict,
    layout: str = "lightseek",
    target_layer_ids=None,
    heads: int = 2,
    markov_rank: int = 8,
    layers: int = 2,
    yarn: bool = True,
) -> dict:
    """The drafter's config.json for ``target_text`` (the target's text config)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}")
    h, n = target_text["hidden_size"], target_text["num_hidden_layers"]
    vocab = target_text["vocab_size"]
    ids = list(target_layer_ids) if target_layer_ids is not None else sorted({0, n // 2, n - 1})
    rope = (
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 32768,
            "rope_theta": 50000.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        if yarn
        else {"rope_type": "default", "rope_theta": 50000.0}
    )
    c = {
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": False,
        "mla_use_output_gate": False,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 1048576,
        "rope_theta": 50000.0,
        "num_target_layers": len(ids),
        "target_hidden_size": h,
        "target_num_hidden_layers": n,
        "target_layer_ids": ids,
    }
    if layout == "lightseek":
        c |= {"fc_norm": True, "aux_hidden_stream": "attn_res"}
    c |= {
        "mask_token_id": vocab - 3,
        "bos_token_id": target_text.get("bos_token_id", 1),
        "eos_token_id": target_text.get("eos_token_id", 2),
        "pad_token_id": target_text.get("pad_token_id", 0),
        "markov_rank": markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
        "draft_vocab_size": vocab,
        "_torchspec_version": "0.1.0",
        "torch_dtype": "bfloat16",
        "rope_parameters": rope,
    }
    return c


def dspark_tensors(
    c: dict, target_embed: torch.Tensor | None, seed: int = 0, dtype=torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Random weights under every published tensor name (``embed_tokens``: ``target_embed`` when given)."""
    gen = torch.Generator().manual_seed(seed)
    h, td, r = c["hidden_size"], c["target_hidden_size"], c["markov_rank"]
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    def norm(k):
        return (1.0 + 0.1 * torch.randn(k, generator=gen)).to(dtype)

    t = {
        "context_proj.weight": w(h, len(c["target_layer_ids"]) * td),
        "context_norm.weight": norm(h),
        "final_norm.weight": norm(h),
        "markov_head.markov_w1.weight": w(c["vocab_size"], r) * 0.5,
        "markov_head.markov_w2.weight": w(c["vocab_size"], r),
        "confidence_head.proj.weight": w(1, h + r),
        "confidence_head.proj.bias": torch.zeros(1, dtype=dtype),
    }
    if c.get("fc_norm"):
        for i in range(len(c["target_layer_ids"])):
            t[f"fc_norm.{i}.weight"] = norm(td)
    if target_embed is not None:
        t["embed_tokens.weight"] = target_embed.to(dtype)
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_a_proj.weight": w(c["q_lora_rank"], h),
            p + "self_attn.q_a_layernorm.weight": norm(c["q_lora_rank"]),
            p + "self_attn.q_b_proj.weight": w(heads * qk, c["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
            p + "self_attn.kv_a_layernorm.weight": norm(c["kv_lora_rank"]),
            p + "self_attn.kv_b_proj.weight": w(heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": w(h, heads * c["v_head_dim"]),
            p + "mlp.gate_proj.weight": w(c["intermediate_size"], h),
            p + "mlp.up_proj.weight": w(c["intermediate_size"], h),
            p + "mlp.down_proj.weight": w(h, c["intermediate_size"]),
        }
    return t


def write_dspark_checkpoint(path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors (one file, as both published drafters ship)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_tiny_dspark(path, target_dir, layout: str = "lightseek", seed: int = 0, **config_kw) -> Path:
    """A random tiny drafter in ``layout`` for the K3 checkpoint in ``target_dir`` (its embedding copied
    from there when the layout ships one)."""
    from safetensors import safe_open

    target = json.loads((Path(target_dir) / "config.json").read_text())
    text = target.get("text_config", target)
    c = dspark_config(text, layout, **config_kw)
    embed = None
    if layout == "lightseek":
        index = Path(target_dir) / "model.safetensors.index.json"
        files = (
            [Path(target_dir) / f for f in set(json.loads(index.read_text())["weight_map"].values())]
            if index.exists()
            else sorted(Path(target_dir).glob("*.safetensors"))
        )
        for f in files:
            with safe_open(str(f), framework="pt") as r:
                for key in r.keys():
                    if key.endswith("model.embed_tokens.weight"):
                        embed = r.get_tensor(key)
    return write_dspark_checkpoint(path, c, dspark_tensors(c, embed, seed))
