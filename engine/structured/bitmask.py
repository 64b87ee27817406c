"""Applying token bitmasks to logits on any device.

A bitmask row holds one bit per vocabulary id (32 per int32 word, id ``i`` at bit ``i % 32`` of
word ``i // 32``, llguidance's layout). On an accelerator the bits are unpacked and applied with
plain torch ops (CUDA and ROCm alike: a few element-wise kernels over [N, V]). On the CPU that
element-wise pass over a 160k vocabulary is the slow part of a step, so the bits are unpacked with
numpy and only the smaller side of each row is written.
"""

from __future__ import annotations

import numpy as np
import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 -> [N, vocab] bool (True: allowed; ids past 32 * W are not)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift of the sign bit still leaves bit 31 in bit 0
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)
    return allowed


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[i], v]`` to -inf where bit ``v`` of ``bitmask[i]`` is clear; in place.
    ``logits`` [R, V] float, ``rows`` [N] int64, ``bitmask`` [N, W] int32, both on the logits'
    device (ids past 32 * W, if any, are masked). Returns ``logits``."""
    if logits.device.type == "cpu":
        return _apply_on_cpu(logits, rows, bitmask)
    return apply_bitmask_torch(logits, rows, bitmask)


def apply_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The device path: unpack and mask with element-wise torch ops."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)


def _apply_on_cpu(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Touch only the smaller side of each row: rebuild it from its allowed ids, or write -inf to its
    blocked ids (inside a JSON string almost every id is allowed, elsewhere almost none)."""
    vocab = logits.shape[1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    for i, r in enumerate(rows.tolist()):
        allowed = bits[i, :vocab]
        row = logits[r]
        ids = np.flatnonzero(allowed)
        if 2 * len(ids) < vocab:
            idx = torch.from_numpy(ids)
            keep = row.index_select(0, idx)
            row.fill_(float("-inf")).index_copy_(0, idx, keep)
        else:
            row.index_fill_(0, torch.from_numpy(np.flatnonzero(allowed == 0)), float("-inf"))
    return logits
