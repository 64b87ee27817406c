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

from dataclasses import dataclass

import torch
from torch import nn

from kimitui.kernels.reference import attn_res_mix  # noqa: F401 - the mix's oracle, this module's public name too


class AttnResProj(nn.Module):
    """The pseudo-query of one mix: ``weight [1, D]`` (checkpoint ``*_res_proj.weight``)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype), requires_grad=False)


@dataclass
class DepthBlocks:
    """The block snapshots a forward carries through the layers: ``buf [capacity, T, D]``, its first
    ``n`` rows filled (one per block begun so far). One buffer rather than a list of tensors, so that
    a fused mix reads every candidate through one pointer and a snapshot is a row it writes."""

    buf: torch.Tensor
    n: int = 0

    @classmethod
    def for_model(cls, num_layers: int, block_size: int, like: torch.Tensor) -> DepthBlocks:
        """Room for the snapshots of ``num_layers`` layers (layers 0, block_size, ... each begin one)
        of ``like [T, D]``'s rows and dtype. ``torch.empty``: no launch."""
        capacity = -(-num_layers // block_size)
        return cls(torch.empty((capacity, *like.shape), dtype=like.dtype, device=like.device))

    @property
    def filled(self) -> torch.Tensor:
        return self.buf[: self.n]

    def select_rows(self, rows: torch.Tensor) -> DepthBlocks:
        """The filled snapshots of token ``rows`` only (a new buffer with no spare room)."""
        return DepthBlocks(self.filled.index_select(1, rows), self.n)
