"""Step inputs land in buffers reused across steps."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.step_buffers import StepBuffers
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
    ptrs = {name: buf.data_ptr(name) for name in ("ids", "decode_tables", "decode_lens", "sample_rows")}
    out = llm.generate([{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [14]}], params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert {name: buf.data_ptr(name) for name in ptrs} == ptrs
