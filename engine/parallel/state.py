"""Who this process is in a tensor/expert-parallel group, and its collectives.

Decided once when the model is built and passed to every layer; with one rank there are no
collectives at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def split_sizes(total: int, parts: int, unit: int = 1) -> list[int]:
    """Uneven split in multiples of ``unit``, the first parts larger (64 heads on 6 ranks:
    11,11,11,11,10,10; 2048 rows in 128-row blocks: 384,384,384,384,256,256). A ``total`` that is
    not a multiple of ``unit`` makes the last non-empty part short."""
    base, extra = divmod(-(-total // unit), parts)
    sizes = [(base + (1 if i < extra else 0)) * unit for i in range(parts)]
    over = sum(sizes) - total
    for i in reversed(range(parts)):
        cut = min(over, sizes[i])
        sizes[i] -= cut
        over -= cut
    return sizes


def split_range(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    sizes = split_sizes(total, parts, unit)
    start = sum(sizes[:index])
    return start, start + sizes[index]


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup, None for a single rank

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def range(self, total: int, unit: int = 1) -> tuple[int, int]:
        """This rank's contiguous slice of ``total`` items (heads, experts, vocab rows, channels),
        cut on multiples of ``unit`` (a quantisation block or group)."""
        return split_range(total, self.world_size, self.rank, unit)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_parallel:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``x`` [..., sizes[r]] along the last dim (uneven sizes allowed)."""
        if not self.is_parallel:
            return x
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


SINGLE = ParallelState()
