"""What one forward step tells every attention layer about the batch.

Tokens are laid out decodes first (one token per decoding sequence), then prefill chunks, each
chunk a contiguous run of rows. Host-side ints describe prefill chunks (a Python loop over
sequences, never over tokens); decodes are described by tensors so they run as one batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    end: int  # one past the last row
    context_len: int  # tokens in the cache for this sequence once the chunk is written
    block_table: torch.Tensor  # [num_blocks] int32 on the model's device


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64, absolute position of each row
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot each row writes to
    block_size: int
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [D] int32, including the new token
    decode_max_context_len: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    # Built on first use and shared by every layer of the step (the metadata lives one step).
    @functools.cached_property
    def decode_slots(self) -> torch.Tensor:
        """Flat cache slots of positions 0..decode_max_context_len-1 of each decode. -> [D, L] int64"""
        return gather_slots_batched(self.decode_block_tables, self.decode_max_context_len, self.block_size)

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """True where position l is past decode b's context (padding of the batch). -> [D, 1, L] bool"""
        pos = torch.arange(self.decode_max_context_len, device=self.decode_context_lens.device)
        return (pos[None, :] >= self.decode_context_lens[:, None])[:, None, :]


def gather_slots(block_table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..num_tokens-1 of one sequence. -> [num_tokens] int64"""
    pos = torch.arange(num_tokens, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def gather_slots_batched(block_tables: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..max_len-1 for each row. -> [B, max_len] int64"""
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables[:, pos // block_size].long()  # [B, L]
    return blocks * block_size + pos % block_size
