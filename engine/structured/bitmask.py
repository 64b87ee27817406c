"""Applying token bitmasks to logits on any device.

A bitmask row holds one bit per vocabulary id (32 per int32 word, id ``i`` at bit ``i % 32`` of
word ``i // 32``, llguidance's layout). Plain torch ops, so it runs on CPU, CUDA and ROCm alike.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 -> [N, vocab] bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift of the sign bit still leaves bit 31 in bit 0
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[i], v]`` to -inf where bit ``v`` of ``bitmask[i]`` is clear; in place.
    ``logits`` [R, V] float, ``rows`` [N] int64, ``bitmask`` [N, W] int32 with 32 * W >= V (ids
    past the bitmask's width, if any, are masked). Returns ``logits``."""
    vocab = logits.shape[1]
    width = bitmask.shape[1] * 32
    allowed = unpack_bitmask(bitmask, min(vocab, width))
    if width < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - width)], dim=1)
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)
