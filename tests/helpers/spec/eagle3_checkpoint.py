"""Tiny EAGLE-3 drafter checkpoints in the published layouts, for a given tiny K2 target config.

Two layouts, as EAGLE-3 drafters are found on the Hub:
- ``"midlayer"`` (SpecForge exports): ``midlayer.*``, ``fc.weight``, ``norm.weight``,
  ``lm_head.weight``, ``d2t``, ``t2d``;
- ``"model"``: the same with a ``model.`` prefix and the layer as ``model.layers.0.*``
  (``lm_head``, ``d2t``, ``t2d`` stay top-level).
``d2t`` holds the offsets target id - draft id of a sorted random draft vocabulary, ``t2d`` the
target-side membership mask. Weights are random; norms are not all ones so a missed one shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LAYER = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def eagle3_config(
    target: dict,
    *,
    hidden_size: int | None = None,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 80,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    norm_before_residual: bool = False,
    rope_scaling: dict | None = None,
    torch_dtype: str = "bfloat16",
) -> dict:
    """A ``LlamaForCausalLMEagle3`` config.json for ``target`` (a K2 config dict). ``hidden_size`` None:
    the target's (as published drafters, which share the target's embedding). ``aux_layer_ids``
    None leaves ``eagle_config`` without ids (the (2, L//2, L-3) default applies)."""
    eagle = {"use_aux_hidden_state": True}
    if aux_layer_ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    vocab = target["vocab_size"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": hidden_size or target["hidden_size"],
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": target.get("max_position_embeddings", 512),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size or vocab,
        "target_hidden_size": target["hidden_size"],
        "norm_before_residual": norm_before_residual,
        "eagle_config": eagle,
        "torch_dtype": torch_dtype,
    }


def eagle3_tensors(
    config: dict, target_layers: int, seed: int = 0, std: float = 0.08, own_embedding: bool = False
) -> dict[str, torch.Tensor]:
    """fp32 weights under canonical names (``fc.weight``, ``layers.0.*``, ``norm.weight``,
    ``lm_head.weight``, ``d2t``, ``t2d``, optionally ``embed_tokens.weight``)."""
    g = torch.Generator().manual_seed(seed)
    h, heads, kv, d = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    inter, vocab, dv, th = (
        config["intermediate_size"],
        config["vocab_size"],
        config["draft_vocab_size"],
        config["target_hidden_size"],
    )
    ids = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids") or (2, target_layers // 2, target_layers - 3)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm_weight(n):
        return torch.rand(n, generator=g) * 0.4 + 0.8

    t = {"fc.weight": rand(h, len(ids) * th), "norm.weight": norm_weight(h), "lm_head.weight": rand(dv, h) * 4}
    shapes = {
        "self_attn.q_proj.weight": (heads * d, 2 * h),
        "self_attn.k_proj.weight": (kv * d, 2 * h),
        "self_attn.v_proj.weight": (kv * d, 2 * h),
        "self_attn.o_proj.weight": (h, heads * d),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    for name in LAYER:
        t[f"layers.0.{name}"] = norm_weight(h) if name.endswith("norm.weight") else rand(*shapes[name])
    vocab_ids = torch.randperm(vocab, generator=g)[:dv].sort().values
    t["d2t"] = vocab_ids - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[vocab_ids] = True
    t["t2d"] = t2d
    if own_embedding:
        t["embed_tokens.weight"] = rand(vocab, h) * 10
    return t


def published_names(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Canonical names -> the ``layout``'s names (see the module docstring)."""
    if layout not in ("midlayer", "model"):
        raise ValueError(f"layout must be 'midlayer' or 'model', got {layout!r}")
    out = {}
    for name, t in tensors.items():
        if name in ("lm_head.weight", "d2t", "t2d"):
            out[name] = t
        elif layout == "midlayer":
            out[name.replace("layers.0.", "midlayer.", 1)] = t
        else:
            out["model." + name] = t
    return out


def write_eagle3_checkpoint(
    path: str | Path,
    target: dict,
    *,
    layout: str = "midlayer",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    own_embedding: bool = False,
    **config_kw,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Write config.json and model.safetensors (float tensors in ``dtype``) for a drafter of the K2
    ``target`` config dict. Returns (config, canonical tensors as written, float ones rounded to
    ``dtype`` and back to fp32)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = eagle3_config(target, torch_dtype=str(dtype).removeprefix("torch."), **config_kw)
    tensors = eagle3_tensors(config, target["num_hidden_layers"], seed, own_embedding=own_embedding)
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in tensors.items()}
    save_file(
        {n: t.contiguous() for n, t in published_names(tensors, layout).items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config, {n: (t.float() if t.is_floating_point() else t) for n, t in tensors.items()}
