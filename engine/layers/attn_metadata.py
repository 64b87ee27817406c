"""What one forward step tells every attention layer about the batch.

Tokens are laid out decodes first (one token per decoding sequence), then prefill chunks, each
chunk a contiguous run of rows. Host-side ints describe prefill chunks (a Python loop over
sequences, never over tokens); decodes are described by tensors so they run as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    end: int  # one past the last row
    context_len: int  # tokens in the cache for this sequence once the chunk is written
    block_table: torch.Tensor  # [num_blocks] int32 on the model's device


@dataclass
class KDAVerifyRows:
    """A verification step in a fixed layout (a decode graph's, engine/runner/verify_graphs.py): ``width``
    positions for each of the step's ``b`` sequences, position-major (row ``j * b + i`` is sequence
    ``i``'s position ``j``). Each row carries its sequence's state slot in ``state_slots``, or -1 (a
    padding position or sequence: no state read or written); after position ``j`` < ``width - 1`` the
    KDA layers copy state slots ``save_src[j]`` -> ``save_dst[j]`` [b] (the sequence's slot into its
    scratch slot for that position, or a slot onto itself: nothing). Every shape is fixed by ``b``
    and ``width``, so a graph can hold the step."""

    width: int
    save_src: torch.Tensor  # [width - 1, b] int64
    save_dst: torch.Tensor  # [width - 1, b] int64


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
    # The rows whose output the step uses (rows to sample, prompt-logprob spans) when that is fewer
    # than all rows. The last layer computes queries, attention and its MLP for these rows only;
    # every layer still writes all rows' latents to the cache. ``out_meta`` is the same batch seen
    # from the kept rows: the decodes, then a suffix of each prefill chunk (possibly empty).
    out_rows: torch.Tensor | None = None  # [K] int64
    out_meta: AttentionMetadata | None = None
    # Hybrid models (KDA layers): the state slot of each sequence of the step, in row order (each
    # decode, then each prefill chunk). A prefill chunk with nothing cached before it starts from a
    # zero state; any other row continues from its slot's state (restored from a prefix snapshot
    # when the scheduler found one).
    state_slots: torch.Tensor | None = None  # [num_decode_tokens + len(prefills)] int64
    # Speculative decoding on hybrid models: when a decode verifies drafts, its 1 + k rows share one
    # slot, so KDA layers step the decode rows position by position (engine.spec_decode.verify.KDASpecStep
    # per position) and keep each position's state for the rollback. None: one row per decode.
    kda_spec: list | None = None
    # the same step as one call's layout (engine.spec_decode.verify.KDASpecLayout), for the recurrence
    kda_spec_layout: object | None = None
    # the same step in a decode graph's fixed position-major layout (``KDAVerifyRows``), in place of both
    kda_verify_rows: KDAVerifyRows | None = None

    def decodes_only(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows is all decodes, every row's output wanted (the fused
        CPU decode paths' precondition)."""
        return not self.prefills and self.out_rows is None and self.num_decode_tokens == rows

    def varlen_prefills(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill chunks packed as one varlen batch, for layers that run them in one call (KDA):
        (cu_seqlens [N+1] int64 over the prefill rows, continues [N] bool: False where a chunk has
        nothing cached before it and starts from a zero state). Built once per step and device, then
        shared by every layer."""
        cached = self.__dict__.setdefault("_varlen_prefills", {})
        if device not in cached:
            d, cu, continues = self.num_decode_tokens, [0], []
            for chunk in self.prefills:
                if chunk.start != d + cu[-1]:
                    raise ValueError(
                        f"prefill chunk rows [{chunk.start}, {chunk.end}) do not follow row "
                        f"{d + cu[-1]} (chunks must be contiguous, after the decodes)"
                    )
                cu.append(chunk.end - d)
                continues.append(chunk.context_len != chunk.end - chunk.start)
            cached[device] = (
                torch.tensor(cu, dtype=torch.int64, device=device),
                torch.tensor(continues, dtype=torch.bool, device=device),
            )
        return cached[device]


def gather_slots(block_table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..num_tokens-1 of one sequence. -> [num_tokens] int64"""
    pos = torch.arange(num_tokens, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size
