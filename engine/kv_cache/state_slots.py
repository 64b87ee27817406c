"""State slots of the hybrid (KDA) cache: one per running sequence, plus prefix snapshots.

Pure Python; the tensors are ``KDAState`` rows in ``state.py``. Slot ids ``[0, max_num_seqs)`` are
handed to running sequences (one each, for the sequence's life between admission and finish,
abort or preemption); ids ``[max_num_seqs, max_num_seqs + num_snapshots)`` hold prefix snapshots:
the state of every KDA layer after exactly the tokens up to the end of one cached block, keyed by
that block's prefix hash (see ``block_manager.hash_block``). A later request whose cached prefix
ends at that block copies the snapshot into its own slot and prefills from there, as vLLM's
``--mamba-cache-mode align`` and SGLang's ``MambaRadixCache`` do.

Snapshots live as long as their block stays in the prefix cache (the block manager drops the
snapshot when it evicts the block) and are themselves evicted least recently used when the
snapshot slots run out; the block then stays cached without one (a "tombstone" in SGLang's words)
and prefix hits are cut back to an earlier block that has one.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    """Hands out per-sequence state slots and keeps the snapshot slots' hash -> slot map."""

    def __init__(self, max_num_seqs: int, num_snapshots: int = 0) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"state slots: max_num_seqs must be >= 1, got {max_num_seqs}")
        if num_snapshots < 0:
            raise ValueError(f"state slots: num_snapshots must be >= 0, got {num_snapshots}")
        self.max_num_seqs = max_num_seqs
        self.num_snapshots = num_snapshots
        # Lowest id first, so a lightly loaded engine touches few slots (and tests read easily).
        self._free_seq: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._owner: dict[int, str] = {}  # slot -> seq_id
        self._free_snap: list[int] = list(range(max_num_seqs + num_snapshots - 1, max_num_seqs - 1, -1))
        # block hash -> snapshot slot, least recently used first (front = next evicted).
        self._snapshots: OrderedDict[int, int] = OrderedDict()
        self._pending: set[int] = set()  # snapshot slots being written this step, not yet keyed

    @property
    def num_slots(self) -> int:
        """Rows every KDA layer's state tensor needs."""
        return self.max_num_seqs + self.num_snapshots

    @property
    def num_free_seq_slots(self) -> int:
        return len(self._free_seq)

    @property
    def num_free_snapshot_slots(self) -> int:
        return len(self._free_snap)

    @property
    def num_snapshots_held(self) -> int:
        return len(self._snapshots)

    # -- sequence slots ---------------------------------------------------------------------

    def allocate(self, seq_id: str) -> int:
        if not self._free_seq:
            raise RuntimeError(
                f"no free state slot for {seq_id!r}: all {self.max_num_seqs} are held "
                f"by {sorted(self._owner.values())[:4]}...; more running sequences than "
                f"max_num_seqs"
            )
        slot = self._free_seq.pop()
        self._owner[slot] = seq_id
        return slot

    def free(self, slot: int, seq_id: str) -> None:
        owner = self._owner.get(slot)
        if owner != seq_id:
            raise RuntimeError(f"state slot {slot} freed by {seq_id!r} but held by {owner!r} (double free?)")
        del self._owner[slot]
        self._free_seq.append(slot)

    # -- snapshots --------------------------------------------------------------------------

    def snapshot_of(self, block_hash: int) -> int | None:
        return self._snapshots.get(block_hash)

    def has_snapshot(self, block_hash: int) -> bool:
        return block_hash in self._snapshots

    def touch(self, block_hash: int) -> int:
        """The snapshot slot of ``block_hash``, marked most recently used (a prefix hit uses it)."""
        self._snapshots.move_to_end(block_hash)
        return self._snapshots[block_hash]

    def reserve_snapshot(self) -> int | None:
        """A snapshot slot to write this step (evicting the least recently used snapshot if none is
        free), or None when every snapshot slot is being written already."""
        if not self._free_snap and self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
            self._free_snap.append(slot)
        if not self._free_snap:
            return None
        slot = self._free_snap.pop()
        self._pending.add(slot)
        return slot

    def commit_snapshot(self, slot: int, block_hash: int) -> bool:
        """Key a written snapshot slot by its block's hash; False (slot freed) if one already is."""
        self._pending.remove(slot)
        if block_hash in self._snapshots:
            self._free_snap.append(slot)
            return False
        self._snapshots[block_hash] = slot
        return True

    def cancel_snapshot(self, slot: int) -> None:
        """Give back a reserved slot whose state must not be kept (its sequence left mid-step)."""
        self._pending.remove(slot)
        self._free_snap.append(slot)

    def drop_snapshot(self, block_hash: int) -> None:
        """Forget the snapshot of a block leaving the prefix cache (no-op if it has none)."""
        slot = self._snapshots.pop(block_hash, None)
        if slot is not None:
            self._free_snap.append(slot)

    # -- checks -----------------------------------------------------------------------------

    def check_consistent(self) -> None:
        """Raise if a slot is lost or counted twice (tests and debugging)."""
        seq = sorted(self._free_seq + list(self._owner))
        if seq != list(range(self.max_num_seqs)):
            raise AssertionError(
                f"sequence state slots inconsistent: free {sorted(self._free_seq)}, held {sorted(self._owner)}"
            )
        snap = sorted(self._free_snap + list(self._snapshots.values()) + list(self._pending))
        if snap != list(range(self.max_num_seqs, self.num_slots)):
            raise AssertionError(
                f"snapshot slots inconsistent: free {sorted(self._free_snap)}, keyed "
                f"{sorted(self._snapshots.values())}, pending {sorted(self._pending)}"
            )

    def held_by(self) -> dict[int, str]:
        """slot -> seq_id for every sequence slot in use (leak reports)."""
        return dict(self._owner)
