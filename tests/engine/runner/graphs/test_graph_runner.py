"""Decode steps on static buffers per batch-size bucket (engine/runner/graphs.py).

On a CPU the graph is replaced by a direct call (the path the device type selects), so the
buckets, padding and static buffers are tested here; real capture runs in the gpu-marked test.
"""

from __future__ import annotations

import pytest
import torch

from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from
from kimitui.engine import LLM, SamplingParams
from kimitui.engine.args import EngineArgs
from kimitui.engine.runner.graphs import DecodeGraphRunner, GraphConfig, batch_buckets, bucket_for
from kimitui.engine.runner.model_runner import ModelRunner, StepInputs
from tests.helpers.checkpoints import write_hf_checkpoint


def test_buckets_are_powers_of_two_up_to_the_capacity():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(n, batch_buckets(48)) for n in (1, 3, 5, 33, 48)] == [1, 4, 8, 48, 48]
    with pytest.raises(ValueError, match="49 sequences exceeds the largest graph bucket \\(48\\)"):
        bucket_for(49, batch_buckets(48))


def test_graph_config_checks_its_fields():
    with pytest.raises(ValueError, match="max_num_seqs \\(0\\)"):
        GraphConfig(0, 4, 16, capture=False)
    assert GraphConfig(8, 4, 16, capture=False).max_context_len == 64
    with pytest.raises(ValueError, match="graph capture needs a cuda/rocm device, got cpu"):
        DecodeGraphRunner(None, [], GraphConfig(8, 4, 16, capture=True), torch.device("cpu"))


def test_enforce_eager_flag_reaches_engine_args():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_args_from(p.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_args_from(p.parse_args([])).enforce_eager is False
    assert EngineArgs().enforce_eager is False


def _runners(tmp_path, max_num_seqs=8):
    write_hf_checkpoint(tmp_path, seed=5, num_hidden_layers=2)
    llm = LLM(
        str(tmp_path), max_model_len=96, max_num_seqs=max_num_seqs, enable_prefix_caching=False, kv_cache_tokens=512
    )
    eager = llm.engine.runner
    assert eager.graphs is None  # a CPU runner is eager unless asked
    graphed = ModelRunner(
        eager.model,
        eager.kv_caches,
        eager.block_size,
        eager.device,
        max_num_seqs=max_num_seqs,
        max_model_len=96,
        decode_graphs=True,
    )
    return llm, eager, graphed


def test_padded_bucket_step_matches_the_eager_step(tmp_path):
    _, eager, graphed = _runners(tmp_path)
    # Three decodes on whatever the cache holds: both runners write the same slots with the same
    # values (the newest token's latent), so running one after the other compares like with like.
    inp = StepInputs(
        ids=[11, 12, 13],
        num_decodes=3,
        decode_tables=[[1, 2], [3], [4, 5, 6]],
        decode_lens=[20, 5, 40],
        prefills=[],
        sample_rows=[0, 1, 2],
    )
    want, _ = eager.forward_step(inp)
    got, prompt = graphed.forward_step(inp)
    assert prompt == [] and got.shape == want.shape == (3, 320)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    g = graphed.graphs
    # Bucket 4: row 3 repeats row 0 (token, table, length), so it reads and writes only row 0's blocks.
    assert g.ids[:4].tolist() == [11, 12, 13, 11]
    assert g.lens[:4].tolist() == [20, 5, 40, 20]
    assert g.tables[3].tolist() == g.tables[0].tolist() == [1, 2, 0, 0, 0, 0]
    ptrs = (g.ids.data_ptr(), g.tables.data_ptr(), g.lens.data_ptr())
    one = StepInputs(ids=[9], num_decodes=1, decode_tables=[[7]], decode_lens=[3], prefills=[], sample_rows=[0])
    torch.testing.assert_close(graphed.forward_step(one)[0], eager.forward_step(one)[0], rtol=1e-4, atol=1e-4)
    assert (g.ids.data_ptr(), g.tables.data_ptr(), g.lens.data_ptr()) == ptrs  # static: filled in place


def test_graph_runner_declines_steps_it_cannot_hold(tmp_path):
    _, _, graphed = _runners(tmp_path, max_num_seqs=2)
    g = graphed.graphs
    assert g.accepts(2, 2, has_prefills=False, stateful=False)
    assert not g.accepts(1, 4, has_prefills=True, stateful=False)  # a prefill chunk rides along
    assert not g.accepts(2, 2, has_prefills=False, stateful=True)  # KDA slots: eager
    assert not g.accepts(3, 3, has_prefills=False, stateful=False)  # above capacity


def test_generation_with_the_static_decode_path_matches_eager(tmp_path):
    llm, eager, graphed = _runners(tmp_path)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}, {"prompt_token_ids": [30, 31, 32, 33]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner = graphed
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert graphed.graphs.lens[:4].tolist() == [8, 7, 9, 8]  # the last decode step ran on the static rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_captured_decode_graph_replays_like_eager(tmp_path):
    write_hf_checkpoint(tmp_path, seed=5, num_hidden_layers=2)
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype="float32",
        max_model_len=96,
        max_num_seqs=8,
        enable_prefix_caching=False,
        kv_cache_tokens=512,
        enforce_eager=True,
    )
    eager = llm.engine.runner
    assert eager.graphs is None
    graphed = ModelRunner(
        eager.model, eager.kv_caches, eager.block_size, eager.device, max_num_seqs=8, max_model_len=96
    )  # auto: captured on cuda
    assert graphed.graphs is not None and graphed.graphs.cfg.capture
    for n in (3, 1, 3):  # capture bucket 4, bucket 1, then replay bucket 4
        inp = StepInputs(
            ids=list(range(11, 11 + n)),
            num_decodes=n,
            decode_tables=[[1 + i, 9] for i in range(n)],
            decode_lens=[17 + i for i in range(n)],
            prefills=[],
            sample_rows=list(range(n)),
        )
        want, _ = eager.forward_step(inp)
        got, _ = graphed.forward_step(inp)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert graphed.graphs.cfg.capture and sorted(graphed.graphs._graphs) == [1, 4]  # no eager fallback
