"""Decode graphs for the verification steps of a hybrid target (Kimi Linear / K3) with drafting on.

A verification step runs ``1 + k`` decode rows per sequence (the last sampled token and its drafts,
engine/runner/model_runner.py). On a model without KDA layers those rows are independent decode rows
and the plain decode graphs replay them (engine/runner/graphs.py). KDA layers are recurrent: a
sequence's rows share one state slot and must be stepped position by position, each position's
state kept for the rollback to the accepted one; the eager path builds that stepping on the host
each step (``KDASpecStep`` lists, ``KDASpecLayout``), which a graph cannot hold.

Here the step has a fixed layout per bucket: ``b`` sequences (a bucket of
``batch_buckets(max_num_seqs)``) times ``width = 1 + num_spec_tokens`` positions, position-major
(row ``j * b + i`` = sequence ``i``'s position ``j``), so KDA position ``j`` is the contiguous row
range ``j*b .. (j+1)*b`` in every step of that bucket (``KDAVerifyRows``; the KDA layer runs one fused
decode step per position in the sequences' own slots and copies the state into the scratch slot of
that position, engine/layers/kda.py ``_verify_rows``). What varies per step is data in static
buffers:

- every row's token, block table and context length (gathered from the step's rows by one index);
- every row's state slot: the sequence's slot for its real positions, ``PAD_SLOT`` for a sequence
  with fewer drafts than ``width - 1`` past its last one, and for padding sequences (no state read or
  written, engine/runner/graph_padding.py);
- the row mask (1 for real rows): routing counts, and ``PAD_SLOT`` as the cache slot of every other
  row, so padding rows write no MLA cache row either;
- the state saves ``save_src[j] -> save_dst[j]``: a sequence with a later real position copies its
  slot into scratch slot ``scratch_base + slot * num_spec_tokens + j`` (where the runner's rollback
  reads it, as on the eager path); every other entry copies a slot onto itself (its real sequence's,
  or sequence 0's for padding; index 0 while capturing), which changes nothing: no other entry of the
  copy writes a sequence slot.

Padding positions repeat their sequence's first row (token, table, context length), padding
sequences sequence 0's first row: attention reads only valid cache rows, and the outputs are dropped
(the step's rows come back by one gather). A step whose sequences all verify ``width - 1`` drafts has
no padding positions; one with fewer drafts (back-off, DSpark's confidence head) pays their rows.
"""

from __future__ import annotations

import torch

from kimitui.engine.layers.attn_metadata import AttentionMetadata, KDAVerifyRows
from kimitui.engine.runner.graph_padding import PAD_SLOT
from kimitui.engine.runner.graphs import DecodeGraphRunner, GraphConfig, batch_buckets, bucket_for


class VerifyGraphRunner(DecodeGraphRunner):
    """Verification steps of a hybrid model on static buffers [max_num_seqs * width, ...], one graph
    per sequence bucket (rows ``b * width``)."""

    def __init__(
        self,
        model,
        kv_caches: list,
        cfg: GraphConfig,
        device: torch.device,
        max_num_seqs: int,
        num_spec_tokens: int,
        scratch_base: int,
    ):
        if num_spec_tokens < 1:
            raise ValueError(f"verify graphs need num_spec_tokens >= 1, got {num_spec_tokens}")
        width = 1 + num_spec_tokens
        if cfg.max_num_seqs < max_num_seqs * width:
            raise ValueError(
                f"verify graphs: {cfg.max_num_seqs} static rows cannot hold {max_num_seqs} sequences x {width} positions"
            )
        super().__init__(model, kv_caches, cfg, device)
        if self.slots is None:
            raise ValueError("verify graphs are for models with KDA layers (no KDAState in the cache)")
        self.width, self.max_seqs = width, max_num_seqs
        self.num_spec_tokens, self.scratch_base = num_spec_tokens, scratch_base
        self.seq_buckets = batch_buckets(max_num_seqs)
        self.buckets = [b * width for b in self.seq_buckets]  # rows per bucket
        self.save = torch.zeros(2, width - 1, max_num_seqs, dtype=torch.int64, device=device)  # (src, dst)

    def accepts_verify(self, spec_lens: list[int], num_rows: int, has_prefills: bool) -> bool:
        """Whether a verification step fits: decodes only, each sequence within ``width`` rows, at most
        ``max_num_seqs`` sequences."""
        return (
            not has_prefills
            and 0 < len(spec_lens) <= self.max_seqs
            and sum(spec_lens) == num_rows
            and 0 < min(spec_lens)
            and max(spec_lens) <= self.width
        )

    def layout(self, spec_lens: list[int], row_slots: list[int]) -> list[int]:
        """The step's layout as one int list (the runner copies it to the device with the step's other
        inputs): for bucket ``b`` of the ``len(spec_lens)`` sequences, ``src`` [b*w] (the step's row each
        static row copies), ``real`` [b*w], ``slot`` [b*w], ``save_src`` and ``save_dst`` [(w-1)*b] and
        ``out`` [n] (the static row of each of the step's n rows). ``row_slots``: the state slot of each
        of the step's rows."""
        w, k = self.width, self.num_spec_tokens
        n_seq = len(spec_lens)
        b = bucket_for(n_seq, self.seq_buckets)
        firsts, at = [], 0
        for n in spec_lens:
            firsts.append(at)
            at += n
        seq_slots = [row_slots[f] for f in firsts]
        src, real, slot = [0] * (b * w), [0] * (b * w), [PAD_SLOT] * (b * w)
        save_src, save_dst = [seq_slots[0]] * ((w - 1) * b), [seq_slots[0]] * ((w - 1) * b)
        out = [0] * at
        for i, (n, f, s) in enumerate(zip(spec_lens, firsts, seq_slots)):
            for j in range(w):
                r = j * b + i
                if j < n:
                    src[r], real[r], slot[r] = f + j, 1, s
                    out[f + j] = r
                else:
                    src[r] = f
                if j < w - 1:
                    keep = j < n - 1  # a later real position follows: keep this one's state for the rollback
                    save_src[j * b + i] = s
                    save_dst[j * b + i] = self.scratch_base + s * k + j if keep else s
        return src + real + slot + save_src + save_dst + out

    def _metadata(self, rows: int) -> AttentionMetadata:
        meta = super()._metadata(rows)
        b = rows // self.width
        meta.kda_verify_rows = KDAVerifyRows(self.width, self.save[0, :, :b], self.save[1, :, :b])
        return meta

    @torch.inference_mode()
    def run_verify(
        self, ids: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, layout: torch.Tensor, num_seqs: int
    ) -> torch.Tensor:
        """Hidden states [n, D] of a verification step of n rows (the runner's row order: each
        sequence's rows in turn), ``layout`` the device copy of ``layout(...)``."""
        n, w = ids.shape[0], self.width
        b = bucket_for(num_seqs, self.seq_buckets)
        rows = b * w
        src, real, slot, save, out_rows = layout.split([rows, rows, rows, 2 * (w - 1) * b, n])
        width = tables.shape[1]
        if width > self.cfg.max_blocks_per_seq:
            raise ValueError(
                f"decode block tables are {width} blocks wide, above the graph capacity {self.cfg.max_blocks_per_seq}"
            )
        self.ids[:rows].copy_(ids.index_select(0, src))
        self.tables[:rows, :width].copy_(tables.index_select(0, src))
        self.lens[:rows].copy_(lens.index_select(0, src))
        self.slots[:rows].copy_(slot)
        self.routing.rows[:rows].copy_(real)
        self.save[:, :, :b].copy_(save.view(2, w - 1, b))
        hidden, aux = self._execute(n, rows)
        if aux is None and getattr(self._aux_owner, "aux_layers", None) is not None:
            aux = self._aux_owner.aux_hidden  # a direct call's (the static rows' order too)
        if aux is not None:  # a block drafter's taps, in the step's row order
            self._aux_owner.aux_hidden = aux.index_select(0, out_rows)
        return hidden.index_select(0, out_rows)

    def _fill_padding(self) -> None:
        super()._fill_padding()
        self.save.zero_()  # slot 0 onto itself: nothing

    def _parked(self, n: int, b: int):
        return _ParkedSaves(self, super()._parked(n, b))


class _ParkedSaves:
    """``DecodeGraphRunner._parked`` plus the saves: warm-ups copy slot 0 onto itself, the step's saves
    come back after."""

    def __init__(self, runner: VerifyGraphRunner, inner):
        self.runner, self.inner, self.saved = runner, inner, None

    def __enter__(self):
        self.saved = self.runner.save.clone()
        self.runner.save.zero_()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.runner.save.copy_(self.saved)
