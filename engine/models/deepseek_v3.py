"""DeepSeek-V3 architecture: Kimi K2, K2 Thinking, K2.5 and K2.6 text models.

Module and parameter names follow Hugging Face's checkpoint names (``model.layers.3.self_attn
.q_a_proj.weight``) so loading is a copy by name; routed experts are the one exception, stacked
per layer (see ``RoutedExperts``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attn_metadata import AttentionMetadata
from engine.layers.linear import Linear
from engine.layers.mla import MLAttention
from engine.layers.mlp import MLP
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.layers.rope import YarnRotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rope: YarnRotaryEmbedding):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, f"{prefix}.self_attn", rope)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config, f"{prefix}.mlp")
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.quantization, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        rope = YarnRotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, max_position)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rope) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]):
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, meta, cache)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int | None = None):
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config, max_position or config.max_position_embeddings)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, config.quantization, "lm_head")

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]):
        """Hidden states [T, D] for a flattened batch (see AttentionMetadata for the row layout)."""
        return self.model(input_ids, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, V]

    def post_load(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.model.layers:
            layer.self_attn.post_load()

    def cache_dims(self) -> list[int]:
        """Values cached per token for each layer (every layer here is MLA)."""
        return [self.config.kv_cache_dim] * self.config.num_hidden_layers
