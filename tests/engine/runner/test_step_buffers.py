"""Step inputs land in buffers reused across steps."""

from __future__ import annotations

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.runner.buffers import StepBuffers
from tests.helpers.checkpoints import write_hf_checkpoint


def test_put_returns_views_of_one_growing_buffer():
    buf = StepBuffers(torch.device("cpu"))
    buf.begin_step()
    a = buf.put("ids", [1, 2, 3], torch.int64)
    ptr, cap = buf.data_ptr("ids"), buf.capacity("ids")
    assert a.tolist() == [1, 2, 3] and cap >= 3
    buf.end_step()
    buf.begin_step()
    b = buf.put("ids", list(range(cap)), torch.int64)  # fits: same memory
    assert buf.data_ptr("ids") == ptr and b.tolist() == list(range(cap))
    c = buf.put("ids", list(range(cap + 1)), torch.int64)  # does not: doubled
    assert buf.capacity("ids") == 2 * cap and c.tolist() == list(range(cap + 1))
    t = buf.put("tables", [[1, 2], [3, 4], [5, 6]], torch.int32)
    assert t.shape == (3, 2) and t.dtype == torch.int32 and t[2].tolist() == [5, 6]
    ragged = buf.put_rows("rows", [[7], [8, 9, 10], []])  # block tables of different lengths, zero-padded
    assert ragged.dtype == torch.int32 and ragged.tolist() == [[7, 0, 0], [8, 9, 10], [0, 0, 0]]
    buf.end_step()


def test_engine_steps_reuse_their_input_buffers(tmp_path):
    write_hf_checkpoint(tmp_path, seed=3, num_hidden_layers=1)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params)
    buf = llm.engine.runner.buffers
    ptrs = {name: buf.data_ptr(name) for name in ("ids", "table_rows", "table_writes", "decode_lens", "sample_rows")}
    tables = (
        llm.engine.runner.device_tables.table.data_ptr()
    )  # the persistent decode tables (engine/runner/block_tables.py)
    out = llm.generate([{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [14]}], params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert {name: buf.data_ptr(name) for name in ptrs} == ptrs
    assert llm.engine.runner.device_tables.table.data_ptr() == tables


def test_put_table_fills_one_fixed_capacity_buffer_in_place():
    buf = StepBuffers(torch.device("cpu"))
    a = buf.put_table("tables", [[7], [8, 9, 10]], (4, 5))
    ptr = buf.data_ptr("tables")
    assert a.shape == (2, 5) and a.stride() == (5, 1) and a.tolist() == [[7, 0, 0, 0, 0], [8, 9, 10, 0, 0]]
    b = buf.put_table("tables", [[1, 2], [3], [4, 5, 6, 7, 8], []], (4, 5))  # stale entries cleared
    assert buf.data_ptr("tables") == ptr and buf.capacity("tables") == 20
    assert b.tolist() == [[1, 2, 0, 0, 0], [3, 0, 0, 0, 0], [4, 5, 6, 7, 8], [0] * 5]
    with pytest.raises(ValueError, match="'tables': 5 rows exceed the capacity of 4 sequences"):
        buf.put_table("tables", [[1]] * 5, (4, 5))
    with pytest.raises(ValueError, match="'tables': row 1 has 6 entries, above the capacity of 5"):
        buf.put_table("tables", [[1], [1] * 6], (4, 5))
    lens = buf.put("lens", [3], torch.int32, capacity=300)
    assert lens.tolist() == [3] and buf.capacity("lens") == 300


def test_engine_decode_tables_have_the_fixed_capacity(tmp_path):
    write_hf_checkpoint(tmp_path, seed=3, num_hidden_layers=1)
    llm = LLM(str(tmp_path), max_model_len=100, max_num_seqs=3, block_size=16, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.table_shape == (3, 7)  # ceil(100 / 16) blocks per sequence
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert runner.device_tables.table.shape == (3, 7)  # the persistent tables: one row per sequence
