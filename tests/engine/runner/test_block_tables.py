"""Persistent decode block tables (engine/runner/block_tables.py): a step sends and writes only the blocks
appended since the last one, so its host work does not depend on ``max_model_len``; the tables the
step gathers equal the sequences' block tables, also after a rebuild (preemption), a release and a
row taken back from a sequence that left without one."""

from __future__ import annotations

import pickle

import pytest
import torch

from kimitui.engine.layers.attn_metadata import AttentionMetadata
from kimitui.engine.runner.block_tables import TableRows
from kimitui.engine.runner.model_runner import ModelRunner
from kimitui.engine.scheduler.output import ScheduledSeq
from kimitui.engine.sequence import Sequence

BLOCK = 16


def _runner(max_model_len: int, max_num_seqs: int = 64) -> ModelRunner:
    return ModelRunner(
        None,
        [],
        BLOCK,
        torch.device("cpu"),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        decode_graphs=False,
    )


def _seqs(n: int, tokens: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(f"s{i}", list(range(1, tokens + 1)))
        s.num_computed_tokens = tokens - 1
        s.block_table = [i * 1000 + j for j in range(-(-tokens // BLOCK))]
        seqs.append(s)
    return seqs


def _decode(seqs) -> list[ScheduledSeq]:
    return [ScheduledSeq(s, 1, False, start=s.num_tokens - 1) for s in seqs]


def _grow(seqs) -> None:
    """Each sequence samples a token; one whose new token starts a block gets a block."""
    for s in seqs:
        s.output_token_ids.append(7)
        s.num_computed_tokens = s.num_tokens - 1
        if len(s.block_table) * BLOCK < s.num_tokens:
            s.block_table.append(s.block_table[-1] + 1)


def _tables(runner, inp) -> torch.Tensor:
    meta = AttentionMetadata(positions=None, slot_mapping=None, block_size=BLOCK, num_decode_tokens=inp.num_decodes)
    runner._decode_inputs(inp, meta)
    return meta.decode_block_tables


def _check(runner, inp, seqs) -> None:
    got = _tables(runner, inp)
    for i, s in enumerate(seqs):
        assert got[i, : len(s.block_table)].tolist() == s.block_table, s.seq_id


def test_step_bytes_and_writes_do_not_depend_on_max_model_len():
    per_len = {}
    for max_len in (8192, 131072):
        runner, seqs = _runner(max_len), _seqs(64, 63 * BLOCK)  # 63 full blocks each: the next token needs one more
        first = runner.prepare(_decode(seqs))
        _check(runner, first, seqs)
        assert sum(len(w[2]) for w in first.table_writes) == 64 * 63 and not first.decode_tables
        steps = []
        for _ in range(3):  # three decode steps: the first appends a block to every sequence
            _grow(seqs)
            inp = runner.prepare(_decode(seqs))
            _check(runner, inp, seqs)
            steps.append((len(pickle.dumps(inp)), sum(len(w[2]) for w in inp.table_writes)))
        per_len[max_len] = steps
    assert per_len[8192] == per_len[131072], per_len
    assert [w for _, w in per_len[8192]] == [64, 0, 0]  # appended blocks only


def test_rebuilt_table_release_and_reclaimed_row():
    runner = _runner(256, max_num_seqs=2)  # 2 rows of 16 blocks
    a, b = _seqs(2, 40)
    inp = runner.prepare(_decode([a, b]))
    _check(runner, inp, [a, b])
    a.block_table = [500, 501, 502]  # preempted and reallocated: a new list, rewritten whole
    inp = runner.prepare(_decode([a, b]))
    assert [w[2] for w in inp.table_writes] == [[500, 501, 502]]
    _check(runner, inp, [a, b])
    runner.release("s1")
    c = Sequence("c", list(range(1, 20)))
    c.num_computed_tokens, c.block_table = 18, [900, 901]
    inp = runner.prepare(_decode([a, c]))  # c takes b's row; its old entries past c's 2 blocks are stale
    _check(runner, inp, [a, c])
    d = Sequence("d", list(range(1, 5)))
    d.num_computed_tokens, d.block_table = 3, [77]
    inp = runner.prepare(_decode([c, d]))  # every row held: a (idle this step) gives its row back
    _check(runner, inp, [c, d])
    with pytest.raises(ValueError, match="more than 2 decoding sequences"):
        e = Sequence("e", [1, 2])
        e.num_computed_tokens, e.block_table = 1, [5]
        runner.prepare(_decode([c, d, e]))


def test_table_rows_reject_a_table_wider_than_the_capacity():
    rows = TableRows(2, 4)
    with pytest.raises(ValueError, match="above the table width 4"):
        rows.row("x", [1, 2, 3, 4, 5], [])
