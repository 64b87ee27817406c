"""The tile layout the CPU quantised MoE kernels stream (``kernels/cpu_quant_moe*.cpp``), and the
conversion to and from the checkpoint layout.

A matrix [N, K] of 4-bit codes (INT4 offset-8 nibbles or E2M1) with one scale per 32 columns is cut
into tiles of 16 output rows (rows past N: zero codes and scales). Each tile is one contiguous run of
bytes, read front to back by one thread, so the hardware prefetcher sees one stream:

    [scales: G groups x 16 rows, bf16 (INT4) or E8M0 bytes, zero-padded to a multiple of 64 bytes]
    [codes:  G groups x 4 blocks x 64 bytes]

where G = ceil(K / 32). Block L of group g holds columns 32g + 8L .. 32g + 8L + 7 of the 16 rows as
32 little-endian 16-bit words: word i is row i // 2, column parity i % 2, and its nibble j (bits
4j..4j+3) is column 32g + 8L + 2j + i % 2. So one 64-byte vector load, shifted by 4j, puts
"lanes = output rows" under a 16-bit (two columns per 32-bit lane, vdpbf16ps) or 32-bit (one column
per lane, shifted by 4m) table lookup, with no shuffles. Codes past K are 8 (INT4: zero) or 0
(E2M1: +0), so a zero-padded activation makes them add nothing.

The bytes are the checkpoint's: the same nibbles and scales, reordered (INT4 group sizes above 32
repeat each scale per 32 columns, the only growth). A layer's w13 is two matrices, gate then up,
each cut into tiles on its own, so gate row j and up row j sit in tiles of the same index.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16
GROUP = 32  # columns per tile group (the kernels' scale granularity)
_BLOCK_BYTES = 256  # codes of one group of one tile


def scale_bytes(fmt: str) -> int:
    return 2 if fmt == "int4" else 1


def tile_bytes(fmt: str, k: int) -> int:
    """Bytes of one 16-row tile of a matrix with K input columns."""
    g = -(-k // GROUP)
    return _scale_block(fmt, g) + g * _BLOCK_BYTES


def _scale_block(fmt: str, groups: int) -> int:
    return -(-(groups * TILE_ROWS * scale_bytes(fmt)) // 64) * 64


def matrix_bytes(fmt: str, n: int, k: int) -> int:
    return -(-n // TILE_ROWS) * tile_bytes(fmt, k)


def _codes(fmt: str, packed: torch.Tensor, k: int) -> torch.Tensor:
    """[..., N, K] uint8 nibble codes of a checkpoint-layout weight."""
    if fmt == "int4":  # int32 words of 8 nibbles, lowest nibble = lowest column
        b = packed.contiguous().view(torch.uint8)
    else:  # bytes of two E2M1 codes, low nibble = even column
        b = packed.contiguous()
    codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)
    return codes[..., :k]


def _scales32(fmt: str, scale: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """[..., N, G] scales, one per 32 columns, as raw bytes [..., N, G, scale_bytes]."""
    g = -(-k // GROUP)
    s = scale.repeat_interleave(group_size // GROUP, dim=-1)[..., :g] if group_size != GROUP else scale[..., :g]
    return s.contiguous().view(torch.uint8).reshape(*s.shape, scale_bytes(fmt))


def repack(fmt: str, packed: torch.Tensor, scale: torch.Tensor, k: int, group_size: int = 32) -> torch.Tensor:
    """Checkpoint-layout [E, N, *] codes + [E, N, groups] scales -> [E, matrix_bytes] uint8 tiles."""
    if group_size % GROUP:
        raise ValueError(f"tile layout: group size {group_size} is not a multiple of {GROUP}")
    e, n = packed.shape[0], packed.shape[1]
    g, t = -(-k // GROUP), -(-n // TILE_ROWS)
    pad_code = 8 if fmt == "int4" else 0
    codes = torch.full((e, t * TILE_ROWS, g * GROUP), pad_code, dtype=torch.uint8)
    codes[:, :n, :k] = _codes(fmt, packed, k)
    # [E, T, 16 rows, G, 4 blocks, 4 nibbles j, 2 parity] -> [E, T, G, L, row, parity, j]
    c = codes.view(e, t, TILE_ROWS, g, 4, 4, 2).permute(0, 1, 3, 4, 2, 6, 5)
    words = c[..., 0::2] | (c[..., 1::2] << 4)  # byte b of a word = nibbles 2b (low), 2b + 1
    body = words.reshape(e, t, g * _BLOCK_BYTES)
    sb = scale_bytes(fmt)
    sc = torch.zeros((e, t * TILE_ROWS, g, sb), dtype=torch.uint8)
    sc[:, :n] = _scales32(fmt, scale, k, group_size)
    sc = sc.view(e, t, TILE_ROWS, g, sb).permute(0, 1, 3, 2, 4).reshape(e, t, g * TILE_ROWS * sb)
    head = torch.zeros((e, t, _scale_block(fmt, g)), dtype=torch.uint8)
    head[..., : sc.shape[-1]] = sc
    return torch.cat((head, body), dim=-1).reshape(e, -1)


def unpack(fmt: str, tiles: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``repack`` with group size 32: ([E, N, *] codes in the checkpoint layout (INT4:
    int32 words, padded with code 8 to whole words), [E, N, ceil(K / 32)] scales)."""
    e = tiles.shape[0]
    g, t = -(-k // GROUP), -(-n // TILE_ROWS)
    sb, head = scale_bytes(fmt), _scale_block(fmt, g)
    per = tiles.view(e, t, head + g * _BLOCK_BYTES)
    sc = per[..., : g * TILE_ROWS * sb].reshape(e, t, g, TILE_ROWS, sb).permute(0, 1, 3, 2, 4)
    sc = sc.reshape(e, t * TILE_ROWS, g * sb)[:, :n].contiguous()
    scale = sc.view(torch.bfloat16) if fmt == "int4" else sc
    words = per[..., head:].reshape(e, t, g, 4, TILE_ROWS, 2, 2)
    c = torch.stack((words & 15, words >> 4), dim=-1).flatten(-2)  # [E, T, G, L, row, parity, j]
    codes = c.permute(0, 1, 4, 2, 3, 6, 5).reshape(e, t * TILE_ROWS, g * GROUP)[:, :n, :k]
    if fmt == "int4":
        kw = -(-k // 8) * 8
        full = torch.full((e, n, kw), 8, dtype=torch.uint8)
        full[..., :k] = codes
        b = full.view(e, n, kw // 2, 2)
        packed = (b[..., 0] | (b[..., 1] << 4)).contiguous().view(torch.int32)
    else:
        b = codes.reshape(e, n, k // 2, 2)
        packed = (b[..., 0] | (b[..., 1] << 4)).contiguous()
    return packed, scale
