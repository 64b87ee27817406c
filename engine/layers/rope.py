"""YaRN rotary embedding on interleaved pairs (DeepSeek-V3 / Kimi K2 layout)."""

from __future__ import annotations

import math

import torch
from torch import nn

from kimitui.engine.config import RopeScaling, yarn_get_mscale


def yarn_inv_freq(dim: int, base: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [dim/2] and the cos/sin amplitude (mscale ratio)."""
    # fp32 throughout, as Hugging Face computes it, so positions far out agree with the oracle.
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None:
        return freqs, 1.0

    def corr_dim(rot: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(corr_dim(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = freqs / scaling.factor * ramp + freqs * (1 - ramp)
    mscale = yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
    return freqs, mscale


class YarnRotaryEmbedding(nn.Module):
    """cos/sin cache indexed by absolute position; applied to interleaved (x[2i], x[2i+1]) pairs."""

    def __init__(self, dim: int, base: float, scaling: RopeScaling | None, max_position: int):
        super().__init__()
        inv_freq, mscale = yarn_inv_freq(dim, base, scaling)
        self.max_position = max_position
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        self.register_buffer("cos", freqs.cos() * mscale, persistent=False)
        self.register_buffer("sin", freqs.sin() * mscale, persistent=False)
        # cos + i sin: on CPU one complex multiply rotates all pairs (bit-identical: the vectorised
        # complex product rounds ac, bd, ad, bc and their sums just as the real formula below)
        self.register_buffer("cis", torch.complex(self.cos, self.sin), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, ..., dim], positions: [T]. Rotate pairs in fp32, return in x's dtype.
        shape = x.shape
        xf = x.float().reshape(shape[0], -1, shape[-1] // 2, 2)
        if x.device.type == "cpu":
            if not xf.is_contiguous() or xf.storage_offset() % 2:  # view_as_complex needs aligned pairs
                xf = xf.clone(memory_format=torch.contiguous_format)
            out = torch.view_as_real(torch.view_as_complex(xf) * self.cis[positions].unsqueeze(1))
            return out.reshape(shape).to(x.dtype)
        cos = self.cos[positions].view(shape[0], 1, -1)  # [T, 1, dim/2]
        sin = self.sin[positions].view(shape[0], 1, -1)
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.reshape(shape).to(x.dtype)
