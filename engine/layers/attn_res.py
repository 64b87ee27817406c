"""Attention residuals (Kimi K3's "Block AttnRes"): each sublayer reads a learned softmax mix of
earlier block sums instead of the plain running residual.

Attention Residuals, arXiv:2603.15031; the control flow below is Moonshot's
``KimiDecoderLayer._forward_attn_residual`` as SGLang reproduces it
(``python/sglang/srt/models/kimi_k3.py``):

    layer L:  prefix = h                          # incoming running sum [T, D]
              if blocks: h = mix(prefix, blocks, self_attention_res_*)
              if L % block_size == 0: blocks += [prefix]; prefix = None   # snapshot, then restart
              a = attn(input_layernorm(h)); prefix = a if prefix is None else prefix + a
              h = mix(prefix, blocks, mlp_res_*)
              prefix = prefix + mlp(post_attention_layernorm(h))
    end:      h = norm(mix(prefix, blocks, output_attn_res_*))

Everything is per token (a token's mix reads only its own depth path), so nothing is cached across
tokens: a decode step carries just its rows' snapshots through the layers.
"""

from __future__ import annotations

import torch
from torch import nn


class AttnResProj(nn.Module):
    """The pseudo-query of one mix: ``weight [1, D]`` (checkpoint ``*_res_proj.weight``)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype), requires_grad=False)


def attn_res_mix(x: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                 proj_weight: torch.Tensor) -> torch.Tensor:
    """Softmax mix over the candidates ``blocks + [x]`` (each [T, D]) -> [T, D] in x.dtype.

    score_i = sum_d rmsnorm(V_i)[d] * norm_weight[d] * proj_weight[0, d]; the mix weights the
    un-normalised V_i. Computed in fp32.
    """
    v = torch.stack([*blocks, x], dim=1).float()  # [T, n + 1, D]
    normed = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    q = norm_weight.float() * proj_weight.float().view(-1)  # [D]: the norm weight folded into the query
    p = torch.softmax(normed @ q, dim=1)  # [T, n + 1]
    return torch.einsum("tn,tnd->td", p, v).to(x.dtype)
