"""The KV cache tensors, one per layer, shaped by that layer's cache kind.

Layers need not agree: DeepSeek-V3 / Kimi K2 layers are all MLA (a paged latent cache), while
Kimi K3's linear-attention layers keep a fixed-size state per sequence. Each layer declares a
``CacheSpec``; paged kinds are indexed by block id (the block manager's ``block_table`` /
``slot_mapping``), state kinds by a state slot id: one per running sequence (``max_num_seqs``)
plus ``num_snapshots`` prefix snapshots (see ``state_slots.py``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


class CacheSpec(abc.ABC):
    """What one layer stores in the KV cache."""

    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one paged block of ``block_size`` tokens costs this layer (0 if not paged)."""
        return 0

    def bytes_per_seq(self) -> int:
        """Bytes of fixed per-sequence state this layer keeps (0 if none)."""
        return 0

    @abc.abstractmethod
    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int, device: torch.device) -> torch.Tensor: ...


@dataclass(frozen=True)
class MLACacheSpec(CacheSpec):
    """Paged MLA latent cache: per token the compressed KV (kv_lora_rank values) followed by the
    shared rope key (qk_rope_head_dim values), so ``dim = kv_lora_rank + qk_rope_head_dim``
    (512 + 64 for Kimi K2). The tensor is ``[num_blocks, block_size, dim]``; slot s is
    ``cache.view(-1, dim)[s]``."""

    dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"MLA cache dim must be positive, got {self.dim}")

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.dim * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size, self.dim, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class StateCacheSpec(CacheSpec):
    """Fixed-size recurrent state per sequence (linear attention, e.g. Kimi K3's KDA layers).

    The tensor is ``[num_slots, *shape]``, indexed by a state slot id (``state_slots.py``). A
    generic shape-only kind; Kimi Linear / K3's KDA layers use ``state.KDAStateSpec``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.shape or any(d < 1 for d in self.shape):
            raise ValueError(f"state shape must be non-empty and positive, got {self.shape}")

    def bytes_per_seq(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(max_num_seqs, *self.shape, dtype=self.dtype, device=device)


def bytes_per_block(specs: list[CacheSpec], block_size: int) -> int:
    """Bytes one block costs across all layers (paged kinds only)."""
    return sum(spec.bytes_per_block(block_size) for spec in specs)


def bytes_of_state(specs: list[CacheSpec], num_slots: int) -> int:
    """Bytes of per-sequence state across all layers for ``num_slots`` state slots."""
    return num_slots * sum(spec.bytes_per_seq() for spec in specs)


def has_state(specs: list[CacheSpec]) -> bool:
    """Whether any layer keeps per-sequence state (a hybrid model that needs state slots)."""
    return any(spec.bytes_per_seq() > 0 for spec in specs)


def num_blocks_for_budget(
    specs: list[CacheSpec], block_size: int, budget_bytes: int, max_num_seqs: int, num_snapshots: int = 0
) -> int:
    """How many blocks fit in ``budget_bytes`` after the state slots (one per sequence plus the
    prefix snapshots) are set aside.

    Returns 0 when nothing fits (callers report "does not fit" with their own context).
    """
    per_block = bytes_per_block(specs, block_size)
    if per_block == 0:
        raise ValueError("no layer has a paged cache; the block count is undefined")
    left = budget_bytes - bytes_of_state(specs, max_num_seqs + num_snapshots)
    return max(0, left // per_block)


def snapshots_for_budget(
    specs: list[CacheSpec], block_size: int, budget_bytes: int, max_num_seqs: int, min_blocks: int, wanted: int
) -> int:
    """The most prefix snapshots, up to ``wanted``, that leave room for ``min_blocks`` blocks
    (0 for a model without per-sequence state)."""
    per_slot = bytes_of_state(specs, 1)
    if per_slot == 0:
        return 0
    left = budget_bytes - bytes_of_state(specs, max_num_seqs) - min_blocks * bytes_per_block(specs, block_size)
    return max(0, min(wanted, left // per_slot))


class KVCachePool:
    """Every layer's cache tensor, allocated once with ``torch.zeros`` on ``device``."""

    def __init__(
        self,
        specs: list[CacheSpec],
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        device: torch.device | str,
        num_snapshots: int = 0,
        num_spec_slots: int = 0,
    ) -> None:
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        if num_blocks < 1 or block_size < 1 or max_num_seqs < 1:
            raise ValueError(
                f"num_blocks, block_size and max_num_seqs must be positive, "
                f"got {num_blocks}, {block_size}, {max_num_seqs}"
            )
        self.specs = list(specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.num_snapshots = num_snapshots if has_state(self.specs) else 0
        # speculative decoding: scratch states of verified positions (engine/runner/model_runner.py), after the snapshots
        self.num_spec_slots = num_spec_slots if has_state(self.specs) else 0
        self.spec_scratch_base = max_num_seqs + self.num_snapshots
        self.device = torch.device(device)
        # State kinds get one row per sequence slot, then one per snapshot slot, then the scratch slots.
        self.caches: list = [
            spec.allocate(num_blocks, block_size, max_num_seqs + self.num_snapshots + self.num_spec_slots, self.device)
            for spec in self.specs
        ]

    @property
    def is_hybrid(self) -> bool:
        return has_state(self.specs)

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.caches[layer]

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def num_bytes(self) -> int:
        return sum(_nbytes(c) for c in self.caches)

    def capacity_tokens(self) -> int:
        """Tokens the paged layers can hold, summed over all sequences."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """One line for the log: layers, blocks, tokens, memory."""
        kinds: dict[str, int] = {}
        for spec in self.specs:
            kinds[type(spec).__name__] = kinds.get(type(spec).__name__, 0) + 1
        layers = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
        slots = ""
        if self.is_hybrid:
            slots = f"; state slots for {self.max_num_seqs} sequences + {self.num_snapshots} prefix snapshots"
        return (
            f"KV cache on {self.device}: {layers}; {self.num_blocks} blocks x {self.block_size} "
            f"= {self.capacity_tokens():,} tokens{slots}, {self.num_bytes / 2**30:.2f} GiB"
        )


def copy_blocks(caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every paged layer's blocks ``dst`` [N] <- blocks ``src`` [N] (int64 on the caches' device,
    distinct destinations; whole blocks, one gather and one scatter per layer, on any device).
    State layers (``KDAState``) are skipped: their rows are state slots, copied by slot."""
    for cache in caches:
        if isinstance(cache, torch.Tensor):
            cache.index_copy_(0, dst, cache.index_select(0, src))


def _nbytes(cache) -> int:
    """Bytes of one layer's cache: a tensor, or a state object holding tensors (KDAState)."""
    if isinstance(cache, torch.Tensor):
        return cache.numel() * cache.element_size()
    return sum(t.numel() * t.element_size() for t in vars(cache).values() if isinstance(t, torch.Tensor))
