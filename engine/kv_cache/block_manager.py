"""Paged KV cache bookkeeping: fixed-size blocks, ref counts, a free list and prefix caching.

Pure Python; the tensors live in ``pool.py``. A block holds the KV of ``block_size`` consecutive
tokens of one sequence. Full, computed blocks are registered under a hash chained over the whole
prefix, so a later request with the same prefix reuses them (ref count > 1) instead of recomputing.
A freed block keeps its hash and stays findable until the free list hands it out again; the free
list is ordered least-recently-freed first, so eviction is LRU.

Hybrid models (KDA layers) pass ``state_slots``: a cached prefix is then only usable up to a block
whose recurrent-state snapshot is kept (the MLA blocks alone cannot rebuild a KDA state), and a
block that leaves the cache takes its snapshot with it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kimitui.engine.kv_cache.state_slots import StateSlots
from kimitui.engine.sequence import Sequence
from kimitui.engine.units import cdiv


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Stable 64-bit hash of a full block given the hash of the block before it (None for the first).

    blake2b rather than ``hash()``: Python's hash of ints is trivially collidable and the value must
    mean the same thing in every process (tensor-parallel ranks, a future on-disk cache).
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Set when the block is full and computed. content_id is unique per registration and
    # parent_content_id names the block before it, so a hit requires the whole prefix to be equal,
    # not just this block's tokens (the guard against hash collisions; see BlockManager._match).
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    content_id: int = 0
    parent_content_id: int = 0

    def clear_content(self) -> None:
        self.hash = None
        self.token_ids = ()
        self.content_id = 0
        self.parent_content_id = 0


class BlockManager:
    """Hands out KV cache blocks to sequences and finds cached prefixes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        state_slots: StateSlots | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = next handed out). Values unused: an ordered set.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._next_content_id = 1
        # Per live sequence: hash chain of its full blocks (tokens never change once written, so
        # it is computed once) and how many of its blocks are registered in the cache.
        self._seq_hashes: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # -- accounting ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, including cached ones that can still be hit or evicted."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prefix-cache hit tokens / tokens looked up at admission (0.0 before any lookup)."""
        if self.num_prefix_query_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # -- admission -------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Number of leading tokens of ``seq`` that the prefix cache holds (no side effects)."""
        return len(self._match(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq`` can be admitted with ``num_new_tokens`` tokens beyond its prefix hit."""
        hit = self._match(seq)
        need = cdiv(len(hit) * self.block_size + num_new_tokens, self.block_size) - len(hit)
        # Reviving a cached block that nobody holds takes it off the free list too.
        revived = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        return need + revived <= len(self._free)

    def allocate(self, seq: Sequence) -> int:
        """Admit ``seq``: claim its cached prefix blocks and return the number of hit tokens.

        Sets ``seq.num_cached_tokens`` and ``seq.num_computed_tokens`` to the hit length, which
        always leaves at least one token to compute so the model produces logits. Blocks for the
        tokens to compute come from ``append_slots``.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.seq_id!r} already holds blocks; free it before re-admitting")
        hit = self._match(seq)
        for bid in hit:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1
        seq.block_table = list(hit)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hit) * self.block_size
        self._num_registered[seq.seq_id] = len(hit)
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += seq.num_cached_tokens
        return seq.num_cached_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make sure blocks exist for tokens ``[num_computed, num_computed + num_new_tokens)``.

        All or nothing: returns False and changes nothing when the free list is too short.
        """
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def can_fork(self, num_tokens: int) -> bool:
        """Whether a free block is there for a fork's private copy of a partial last block."""
        return num_tokens % self.block_size == 0 or len(self._free) >= 1

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give ``child`` the KV of ``parent``'s first ``num_tokens`` tokens (an ``n > 1`` request's
        sample forked from the one that computed the prompt, engine/sampling/fanout.py).

        Full blocks are shared (one more reference each: they never change again, as a prefix hit's
        blocks). A partial last block would be written by both sequences' next tokens, so the child
        gets a fresh block, and the (source, destination) pair the runner must copy (every layer's
        rows of that block) is returned; None when ``num_tokens`` ends on a block boundary.
        The parent registers the shared blocks in the prefix cache; the child only its own from the
        copy on. Call ``can_fork`` first: this raises when no block is free.
        """
        if child.block_table:
            raise RuntimeError(f"{child.seq_id!r} already holds blocks; a fork starts from none")
        bs = self.block_size
        num_full, partial = divmod(num_tokens, bs)
        if len(parent.block_table) < num_full + (1 if partial else 0):
            raise RuntimeError(
                f"{parent.seq_id!r} holds {len(parent.block_table)} blocks, fewer than its "
                f"{num_tokens} tokens to fork need"
            )
        if partial and not self._free:
            raise RuntimeError(f"no free block to fork {child.seq_id!r} from {parent.seq_id!r}")
        shared = parent.block_table[:num_full]
        for bid in shared:
            self.blocks[bid].ref_count += 1  # held by the parent: never on the free list
        child.block_table = list(shared)
        hashes = self._seq_hashes.get(parent.seq_id)
        if hashes:  # the same tokens: the same chain, no need to hash them again
            self._seq_hashes[child.seq_id] = hashes[:num_full]
        self._num_registered[child.seq_id] = num_full
        if not partial:
            return None
        dst = self._take_free_block()
        child.block_table.append(dst)
        return parent.block_table[num_full], dst

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (safe to call on a sequence that holds none)."""
        # Tail first: the last blocks of a prefix are the least likely to be shared later, so they
        # should be evicted before the head blocks.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed more often than allocated"
            if block.ref_count == 0:
                self._free[bid] = None
                if not self._is_cached(block):
                    self._free.move_to_end(bid, last=False)  # nothing to keep: reuse it first
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)

    # -- after a step ----------------------------------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Put the blocks that ``seq`` has completely filled since last time into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_registered.get(seq.seq_id, 0)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            block.hash = self._hash_at(seq, i)
            block.token_ids = self._block_tokens(seq, i)
            block.parent_content_id = self.blocks[seq.block_table[i - 1]].content_id if i else 0
            block.content_id = self._next_content_id
            self._next_content_id += 1
            other = self.blocks[self._cached.get(block.hash, block.block_id)]
            if (
                other is not block
                and other.token_ids == block.token_ids
                and other.parent_content_id == block.parent_content_id
            ):
                # A duplicate of the cached block (two sequences computed the same prefix side by
                # side): same content, same id, so the blocks this sequence registers after it
                # chain to the cached prefix and stay findable.
                block.content_id = other.content_id
            # First writer wins: an existing entry may already be shared by other sequences.
            self._cached.setdefault(block.hash, block.block_id)
        self._num_registered[seq.seq_id] = max(start, num_full)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot of each token position in ``[start, end)``: block_table[i // bs] * bs + i % bs."""
        bs, table = self.block_size, seq.block_table
        slots: list[int] = []
        i = start
        while i < end:
            offset = i % bs
            n = min(bs - offset, end - i)
            base = table[i // bs] * bs + offset
            slots.extend(range(base, base + n))
            i += n
        return slots

    def block_hash(self, seq: Sequence, i: int) -> int:
        """Prefix hash of ``seq``'s full block ``i`` (its tokens must all be known)."""
        return self._hash_at(seq, i)

    def is_cached_block(self, block_id: int, block_hash: int) -> bool:
        """Whether ``block_id`` is the prefix cache's block for ``block_hash`` (registered, not evicted)."""
        return self._cached.get(block_hash) == block_id

    # -- internals -------------------------------------------------------------------------

    def _is_cached(self, block: Block) -> bool:
        return block.hash is not None and self._cached.get(block.hash) == block.block_id

    def _take_free_block(self) -> int:
        bid, _ = self._free.popitem(last=False)
        block = self.blocks[bid]
        if self._is_cached(block):
            del self._cached[block.hash]  # evicted: its content is about to be overwritten
            if self.state_slots is not None:
                self.state_slots.drop_snapshot(block.hash)
        block.clear_content()
        block.ref_count = 1
        return bid

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(seq.tokens_in_range(i * bs, (i + 1) * bs))

    def _hash_at(self, seq: Sequence, i: int) -> int:
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(hash_block(hashes[-1] if j else None, self._block_tokens(seq, j)))
        return hashes[i]

    def _match(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        params = seq.sampling_params
        if getattr(params, "prompt_logprobs", None) is not None or getattr(params, "logprob_rows", False):
            return []  # prompt log-probs (and rows) need every prompt row computed, as in vLLM
        hit: list[int] = []
        parent_content_id = 0
        # (num_tokens - 1) // bs: never hit the block holding the last token; it must be computed.
        for i in range((seq.num_tokens - 1) // self.block_size):
            bid = self._cached.get(self._hash_at(seq, i))
            if bid is None:
                break
            block = self.blocks[bid]
            if block.parent_content_id != parent_content_id or block.token_ids != self._block_tokens(seq, i):
                break  # hash collision: same hash, different prefix
            hit.append(bid)
            parent_content_id = block.content_id
        if self.state_slots is not None:
            # A hybrid model resumes from a state snapshot: cut back to the last block that has one.
            while hit and not self.state_slots.has_snapshot(self.blocks[hit[-1]].hash):
                hit.pop()
        return hit
