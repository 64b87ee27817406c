"""A small random DeepSeek-V3-style MLA layer for the MLA tests (long prefill, fused decode)."""

import torch

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.mla import MLAttention
from kimitui.engine.layers.rope import YarnRotaryEmbedding
from tests.helpers.checkpoints import BASE


def random_mla_layer(heads: int, seed: int = 0, ops=None) -> MLAttention:
    """``model.layers.0.self_attn`` of the tiny BASE config with ``heads`` heads: norms drawn in
    [0.5, 1.5), other weights N(0, 0.2^2) from one generator seeded ``seed``, then ``post_load``.
    ``ops``: a kernel backend set on every submodule (as ``kernels.select.attach_backends`` does);
    None keeps the layer's default."""
    config = ModelConfig.from_dict(
        {
            **BASE,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
        }
    )
    c = config
    rope = YarnRotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    layer = MLAttention(config, "model.layers.0.self_attn", rope)
    if ops is not None:
        for module in layer.modules():
            module.ops = ops
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(
                torch.rand(p.shape, generator=g) + 0.5
                if "layernorm" in name
                else torch.randn(p.shape, generator=g) * 0.2
            )
    layer.post_load()
    return layer
