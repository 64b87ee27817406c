"""A dense float64 EAGLE-3 layer built from Hugging Face's Llama pieces (RMSNorm, rotary embedding,
MLP), the oracle of the drafter and proposer tests; and the target's aux hidden states from
Hugging Face's own layer outputs."""

from __future__ import annotations

import torch


def hf_llama(config: dict):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default"} if config["rope_scaling"] is None else dict(config["rope_scaling"])
    rope["rope_theta"] = config["rope_theta"]
    c = LlamaConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters=rope,
        max_position_embeddings=config["max_position_embeddings"],
    )
    return c, LlamaRotaryEmbedding(c)


def reference(config: dict, w: dict, embed: torch.Tensor, tokens: list[int], hidden: list[torch.Tensor]):
    """Dense float64 EAGLE-3 layer over one sequence's rows 0..N-1 (row p at position p, input token
    tokens[p], hidden state hidden[p] [H]). -> (pre-norm [N, H], normed [N, H])."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

    c, rotary = hf_llama(config)
    eps, h, d = config["rms_norm_eps"], config["hidden_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    W = {k: v.double() for k, v in w.items() if v.is_floating_point()}

    def rms(name, x):
        n = LlamaRMSNorm(h, eps).double()
        n.weight.data = W[name]
        return n(x)

    n = len(tokens)
    x_emb = embed.double()[torch.tensor(tokens)]
    hid = torch.stack(hidden).double()
    hn = rms("layers.0.hidden_norm.weight", hid)
    residual = hn if config["norm_before_residual"] else hid
    x = torch.cat([rms("layers.0.input_layernorm.weight", x_emb), hn], -1)
    q = (x @ W["layers.0.self_attn.q_proj.weight"].T).view(1, n, heads, d).transpose(1, 2)
    k = (x @ W["layers.0.self_attn.k_proj.weight"].T).view(1, n, kv, d).transpose(1, 2)
    v = (x @ W["layers.0.self_attn.v_proj.weight"].T).view(1, n, kv, d).transpose(1, 2)
    cos, sin = rotary(x.float(), torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    s = (q @ k.transpose(-1, -2)) * d**-0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    a = (s.softmax(-1) @ v).transpose(1, 2).reshape(n, heads * d) @ W["layers.0.self_attn.o_proj.weight"].T
    residual = residual + a
    mlp = LlamaMLP(c).double()
    for p in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, p).weight.data = W[f"layers.0.mlp.{p}.weight"]
    out = mlp(rms("layers.0.post_attention_layernorm.weight", residual)) + residual
    return out, rms("norm.weight", out)


def hf_aux_states(hf, ids: list[int], layer_ids) -> torch.Tensor:
    """The hidden states entering each layer of ``layer_ids`` (ascending; L = the final pre-norm
    hidden) of a Hugging Face DeepSeek-V3 model over ``ids``, concatenated: [T, n * D] fp32."""
    outs = []
    hooks = [
        layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
        for layer in hf.model.layers
    ]
    try:
        with torch.no_grad():
            t = torch.tensor([ids])
            states = [hf.model.embed_tokens(t)]
            hf(t)
    finally:
        for h in hooks:
            h.remove()
    states += outs
    return torch.cat([states[k][0].float() for k in sorted(layer_ids)], dim=-1)
