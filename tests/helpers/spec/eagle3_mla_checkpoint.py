"""Tiny MLA EAGLE-3 / EAGLE-3.1 drafter checkpoints (``Eagle3DeepseekV2ForCausalLM``) for a tiny K2
target, in the published layout of lightseekorg/kimi-k2.6-eagle3-mla and its EAGLE-3.1 variant as
vLLM's ``deepseek_eagle3.py`` loads them: top-level ``fc.weight``, ``norm.weight``, ``lm_head.weight``
(full vocabulary: no ``d2t`` / ``t2d``), ``midlayer.*`` with the DeepSeek attention names
(``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``o_proj``) and, for 3.1, ``fc_norm.<i>.weight`` with ``fc_norm`` / ``norm_output``
set in config.json. Also a dense float64 reference of the layer, written from the DeepSeek-V3
attention equations with Hugging Face's rotary pieces (interleaved pairs, YaRN)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ATTN = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def mla_config(
    target: dict,
    *,
    aux_layer_ids=(1, 3, 6),
    v31: bool = False,
    heads: int = 4,
    q_lora_rank: int = 24,
    kv_lora_rank: int = 16,
    nope: int = 8,
    rope: int = 8,
    v_head_dim: int = 12,
    intermediate_size: int = 80,
    torch_dtype: str = "bfloat16",
    top_level_ids: bool = False,
) -> dict:
    c = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 1,
        "hidden_size": target["hidden_size"],
        "target_hidden_size": target["hidden_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_head_dim,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": target["rope_theta"],
        "rope_scaling": target["rope_scaling"],
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": target["vocab_size"],
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if top_level_ids:
        c["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    else:
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    if v31:
        c["fc_norm"] = c["norm_output"] = True
    return c


def mla_tensors(c: dict, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    """fp32 weights under the published names."""
    g = torch.Generator().manual_seed(seed)
    h, heads, qr, kr = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vd, inter = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["intermediate_size"]
    n_aux = len(c["eagle_config"].get("eagle_aux_hidden_state_layer_ids") or c["eagle_aux_hidden_state_layer_ids"])

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return torch.rand(n, generator=g) * 0.4 + 0.8

    t = {
        "fc.weight": rand(h, n_aux * c["target_hidden_size"]),
        "norm.weight": norm(h),
        "lm_head.weight": rand(c["vocab_size"], h) * 4,
    }
    a = "midlayer.self_attn."
    t.update(
        {
            a + "q_a_proj.weight": rand(qr, 2 * h),
            a + "q_a_layernorm.weight": norm(qr),
            a + "q_b_proj.weight": rand(heads * (nope + rope), qr),
            a + "kv_a_proj_with_mqa.weight": rand(kr + rope, 2 * h),
            a + "kv_a_layernorm.weight": norm(kr),
            a + "kv_b_proj.weight": rand(heads * (nope + vd), kr),
            a + "o_proj.weight": rand(h, heads * vd),
        }
    )
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{n}.weight"] = norm(h)
    t.update(
        {
            "midlayer.mlp.gate_proj.weight": rand(inter, h),
            "midlayer.mlp.up_proj.weight": rand(inter, h),
            "midlayer.mlp.down_proj.weight": rand(h, inter),
        }
    )
    if c.get("fc_norm"):
        for i in range(n_aux):
            t[f"fc_norm.{i}.weight"] = norm(c["target_hidden_size"])
    return t


def write_mla_checkpoint(
    path: str | Path,
    target: dict,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tensors: dict[str, torch.Tensor] | None = None,
    drop=(),
    layout: str = "midlayer",
    **config_kw,
):
    """config.json + model.safetensors; ``tensors`` (published names) replaces the random ones;
    ``drop``: names left out (e.g. ``lm_head.weight``: shared with the target); ``layout``:
    ``midlayer`` (SpecForge / ModelOpt names) or ``torchspec`` (TorchSpec's export, which renames
    ``midlayer.`` to ``layers.0.``: lightseekorg's files). -> (config, fp32 tensors, midlayer names)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = mla_config(target, torch_dtype=str(dtype).removeprefix("torch."), **config_kw)
    t = mla_tensors(c, seed) if tensors is None else tensors
    t = {n: v.to(dtype) for n, v in t.items() if n not in drop}
    disk = {
        ("layers.0." + n[len("midlayer.") :] if layout == "torchspec" and n.startswith("midlayer.") else n): v
        for n, v in t.items()
    }
    save_file({n: v.contiguous() for n, v in disk.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c, indent=2))
    return c, {n: v.float() for n, v in t.items()}


def mla_reference(c: dict, w: dict, embed: torch.Tensor, tokens: list[int], hidden: list[torch.Tensor]):
    """Dense float64 layer over one sequence's rows 0..N-1 (row p at position p, input token
    tokens[p], hidden state hidden[p] [H], already through fc). -> (pre-norm [N, H], normed [N, H])."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    W = {k: v.double() for k, v in w.items()}
    eps, heads = c["rms_norm_eps"], c["num_attention_heads"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * W[name]

    n = len(tokens)
    a = "midlayer.self_attn."
    hid = torch.stack(hidden).double()
    x = torch.cat(
        [
            rms(embed.double()[torch.tensor(tokens)], "midlayer.input_layernorm.weight"),
            rms(hid, "midlayer.hidden_norm.weight"),
        ],
        -1,
    )
    q = rms(x @ W[a + "q_a_proj.weight"].T, a + "q_a_layernorm.weight") @ W[a + "q_b_proj.weight"].T
    q = q.view(1, n, heads, nope + rope).transpose(1, 2)
    kv_a = x @ W[a + "kv_a_proj_with_mqa.weight"].T
    latent, k_pe = kv_a[:, : c["kv_lora_rank"]], kv_a[:, c["kv_lora_rank"] :]
    kv = (rms(latent, a + "kv_a_layernorm.weight") @ W[a + "kv_b_proj.weight"].T).view(1, n, heads, nope + vd)
    kv = kv.transpose(1, 2)
    hc = DeepseekV3Config(
        hidden_size=c["hidden_size"],
        num_attention_heads=heads,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        rope_theta=c["rope_theta"],
        rope_scaling=c["rope_scaling"],
        max_position_embeddings=c["max_position_embeddings"],
    )
    cos, sin = DeepseekV3RotaryEmbedding(hc)(x.float(), torch.arange(n)[None])
    q_pe, k_pe = apply_rotary_pos_emb_interleave(q[..., nope:], k_pe.view(1, 1, n, rope), cos.double(), sin.double())
    qf = torch.cat([q[..., :nope], q_pe], -1)
    kf = torch.cat([kv[..., :nope], k_pe.expand(1, heads, n, rope)], -1)
    scale = (nope + rope) ** -0.5
    rs = c["rope_scaling"]
    if rs and rs.get("mscale_all_dim"):
        scale *= (0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0) ** 2
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ kv[..., nope:]).transpose(1, 2).reshape(n, heads * vd) @ W[a + "o_proj.weight"].T
    residual = hid + o
    y = rms(residual, "midlayer.post_attention_layernorm.weight")
    m = "midlayer.mlp."
    out = (torch.nn.functional.silu(y @ W[m + "gate_proj.weight"].T) * (y @ W[m + "up_proj.weight"].T)) @ W[
        m + "down_proj.weight"
    ].T + residual
    return out, rms(out, "norm.weight")


def mla_combine(c: dict, w: dict, aux: torch.Tensor) -> torch.Tensor:
    """fc (after EAGLE-3.1's per-chunk fc_norm) over aux [T, n * D], float64."""
    x = aux.double()
    if c.get("fc_norm"):
        d, eps = c["target_hidden_size"], c["rms_norm_eps"]
        parts = x.split(d, dim=-1)
        x = torch.cat(
            [
                p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps) * w[f"fc_norm.{i}.weight"].double()
                for i, p in enumerate(parts)
            ],
            -1,
        )
    return x @ w["fc.weight"].double().T
