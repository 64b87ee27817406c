"""Per-sequence recurrent state of a linear-attention (KDA) layer, indexed by a state slot.

A Kimi Linear / Kimi K3 KDA layer keeps, for every running sequence, a fixed-size state instead of
a growing paged cache: the delta-rule matrix per head and the last ``conv_kernel - 1`` inputs of its
short causal convolutions. The scheduler hands each sequence one slot id (``Sequence.state_slot``)
for its whole life and frees it with the sequence; the runner passes the slots of a step in
``AttentionMetadata.state_slots``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimitui.engine.kv_cache.pool import CacheSpec


@dataclass
class KDAState:
    """One KDA layer's state for every slot, on the layer's device."""

    recurrent: torch.Tensor  # [num_slots, H, head_k_dim, head_v_dim] float32, the delta-rule state S
    conv: torch.Tensor  # [num_slots, conv_channels, conv_kernel - 1] float32: q | k | v channels, oldest first

    @property
    def num_slots(self) -> int:
        return int(self.recurrent.shape[0])

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the state of ``slots`` [N] int64 (a sequence that starts from nothing)."""
        self.recurrent.index_fill_(0, slots, 0.0)
        self.conv.index_fill_(0, slots, 0.0)

    def copy_slot(self, src: int, dst: int) -> None:
        self.recurrent[dst].copy_(self.recurrent[src])
        self.conv[dst].copy_(self.conv[src])


@dataclass(frozen=True)
class KDAStateSpec(CacheSpec):
    """What one KDA layer keeps per sequence, on this rank (heads and channels are this rank's share).

    ``conv_channels`` is the width of the three short convolutions together: q and k have
    ``num_heads * head_k_dim`` channels each, v ``num_heads * head_v_dim``.
    """

    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    dtype: torch.dtype = torch.float32  # the state is accumulated in fp32 whatever the model dtype

    @property
    def conv_channels(self) -> int:
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)

    def bytes_per_seq(self) -> int:
        size = self.dtype.itemsize
        return size * (self.num_heads * self.head_k_dim * self.head_v_dim + self.conv_channels * (self.conv_kernel - 1))

    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int, device: torch.device) -> KDAState:
        return KDAState(
            torch.zeros(
                max_num_seqs, self.num_heads, self.head_k_dim, self.head_v_dim, dtype=self.dtype, device=device
            ),
            torch.zeros(max_num_seqs, self.conv_channels, self.conv_kernel - 1, dtype=self.dtype, device=device),
        )


def copy_state_slots(states: list[KDAState], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every KDA layer's slots ``dst`` [N] <- slots ``src`` [N] (distinct destinations)."""
    for state in states:
        state.recurrent.index_copy_(0, dst, state.recurrent.index_select(0, src))
        state.conv.index_copy_(0, dst, state.conv.index_select(0, src))
