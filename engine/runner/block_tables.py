"""Decode block tables that persist across steps: a step sends only the blocks appended since.

A decode reads its sequence's whole block table. Rebuilding ``[decodes, max_blocks_per_seq]`` every
step costs host time in ``max_model_len``, not in what the sequences hold (measured before this
module, 64 sequences at a 128K-token ``max_model_len``: 27 ms fill, 13 ms pickle, 25 ms unpickle per
worker, issue 38), and K3's 1M context moved 16.8 MB a step for short prompts. As vLLM's v1
``BlockTable`` does, every running sequence instead owns one row of a table
``[rows, max_blocks_per_seq]`` that lives on the device of every rank:

- ``TableRows`` (rank 0, in ``ModelRunner.prepare``) gives each decoding sequence a row and turns
  what changed since its last step into writes ``(flat index, block id)``: its new blocks only, or
  its whole table when the table was rebuilt (a sequence's ``block_table`` list is replaced, not
  edited, when its blocks are freed or reallocated: preemption, a prefix hit, a fork), or when it
  was given a new row. The writes ``(row, first column, block ids)`` and the rows travel in
  ``StepInputs`` (pickled to workers), so their bytes do not depend on the table's width either.
- ``DeviceTables`` (every rank, in ``ModelRunner.forward_step``) applies the writes with one
  ``index_copy_`` and gathers the step's rows on the device.

Host work and bytes per step then grow with appended blocks (about one per sequence every
``block_size`` tokens), not with ``max_model_len``; the gather of ``[decodes, width]`` is device
work. A row's entries past its table's length may hold a former owner's block ids: they are valid
ids, and attention reads a table only up to the row's context length.
"""

from __future__ import annotations

import torch

from kimitui.engine.runner.buffers import StepBuffers


class TableRows:
    """Which table row each sequence holds, and what it already has there (rank 0's bookkeeping)."""

    def __init__(self, num_rows: int, width: int):
        if num_rows < 1 or width < 1:
            raise ValueError(f"block tables need >= 1 row and column, got {num_rows} x {width}")
        self.num_rows, self.width = num_rows, width
        self._free = list(range(num_rows - 1, -1, -1))
        # seq_id -> [row, the block_table list last written, how many of its blocks the row holds, last step]
        self._held: dict[str, list] = {}
        self._step = 0

    def begin_step(self) -> None:
        self._step += 1

    def row(self, seq_id: str, table: list[int], writes: list[tuple[int, int, list[int]]]) -> int:
        """The row of ``seq_id`` (whose block table is ``table``), appending to ``writes`` the
        ``(row, first column, block ids)`` that make the row start with ``table``."""
        if len(table) > self.width:
            raise ValueError(f"sequence {seq_id!r} holds {len(table)} blocks, above the table width {self.width}")
        held = self._held.get(seq_id)
        if held is None:
            held = self._held[seq_id] = [self._take_row(), table, 0, self._step]
        elif held[1] is not table or held[2] > len(table):  # rebuilt (freed, reallocated, forked): rewrite
            held[1], held[2] = table, 0
        row, _, known, _ = held
        if known < len(table):
            writes.append((row, known, table[known:]))
            held[2] = len(table)
        held[3] = self._step
        return row

    def release(self, seq_id: str) -> None:
        held = self._held.pop(seq_id, None)
        if held is not None:
            self._free.append(held[0])

    def _take_row(self) -> int:
        if not self._free:
            # every row held: reclaim the one idle longest (a sequence not in this step; released
            # sequences give theirs back, so this only covers ones that left without a release)
            seq_id, held = min(
                ((s, h) for s, h in self._held.items() if h[3] < self._step),
                key=lambda e: e[1][3],
                default=(None, None),
            )
            if seq_id is None:
                raise ValueError(f"more than {self.num_rows} decoding sequences in one step")
            del self._held[seq_id]
            self._free.append(held[0])
        return self._free.pop()


class DeviceTables:
    """One rank's copy of the persistent tables ``[rows, width]`` int32, on its device."""

    def __init__(self, num_rows: int, width: int, device: torch.device):
        self.width = width
        self.table = torch.zeros(num_rows, width, dtype=torch.int32, device=device)

    def apply(self, buf: StepBuffers, writes: list[tuple[int, int, list[int]]]) -> None:
        """Each ``(row, first column, block ids)`` into the table (one copy to the device, one scatter)."""
        if not writes:
            return
        idx, ids, w = [], [], self.width
        for row, col, blocks in writes:
            idx.extend(range(row * w + col, row * w + col + len(blocks)))
            ids.extend(blocks)
        writes = buf.put("table_writes", [idx, ids], torch.int64)  # [2, m]
        self.table.view(-1).index_copy_(0, writes[0], writes[1].to(torch.int32))

    def gather(self, buf: StepBuffers, rows: list[int], width: int) -> torch.Tensor:
        """The step's decode tables [len(rows), width] (width <= the table's), gathered on the device."""
        index = buf.put("table_rows", rows, torch.int64)
        return self.table[:, :width].index_select(0, index)
