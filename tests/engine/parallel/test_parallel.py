"""Tensor/expert parallel over gloo processes and CPU-computed experts give the one-process answer."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.parallel.state import split_sizes
from kimitui.engine.parallel.workers import WorkerError
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

# 7 heads, 10 experts, 331 vocabulary rows: none divides by 4 or 6
SHAPE = dict(
    num_attention_heads=7,
    n_routed_experts=10,
    vocab_size=331,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    n_shared_experts=2,
    intermediate_size=90,
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp")
    write_hf_checkpoint(path, seed=5, **SHAPE)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(331) for _ in range(n)] for n in (5, 30, 70)]


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    return LLM(ckpt, max_model_len=128, max_num_seqs=4).generate(prompts, PARAMS)


def _assert_same(ref, outs):
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for i in range(1, len(a.prompt_logprobs)):
            for tok, lp in a.prompt_logprobs[i].items():
                assert abs(b.prompt_logprobs[i][tok] - lp) < 1e-4


def test_uneven_splits():
    assert split_sizes(64, 6) == [11, 11, 11, 11, 10, 10]
    assert split_sizes(331, 4) == [83, 83, 83, 82]


@pytest.mark.parametrize("world", [2, 4, 6])
def test_tensor_parallel_matches_one_process(ckpt, prompts, reference, world):
    with LLM(ckpt, max_model_len=128, max_num_seqs=4, tensor_parallel_size=world) as llm:
        _assert_same(reference, llm.generate(prompts, PARAMS))


def test_n_samples_are_forked_on_every_rank(ckpt, prompts, reference):
    """n = 3 greedy under tensor parallel: each rank copies its share of the partial last block for
    the forked samples (StepInputs.block_copies), so all three equal the one-process answer."""
    with LLM(ckpt, max_model_len=128, max_num_seqs=9, tensor_parallel_size=2) as llm:  # room for all 9 samples
        outs = llm.generate(prompts, dataclasses.replace(PARAMS, n=3))
        assert llm.engine.stats().computed_prompt_tokens == sum(len(p) for p in prompts)
    for a, b in zip(reference, outs):
        assert [c.token_ids for c in b.outputs] == [a.outputs[0].token_ids] * 3


@pytest.fixture(scope="module", params=["fp8", "int4"])
def quantized(request, tmp_path_factory, prompts):
    """A quantised checkpoint (FP8: q_b_proj heads of 16 + 8 rows, so 4- and 6-way shards start
    inside 16-row scale blocks) and its one-process answer."""
    path = tmp_path_factory.mktemp(request.param)
    hf = write_hf_checkpoint(path, seed=5, **SHAPE, qk_rope_head_dim=8)
    quantize_checkpoint(path, request.param, hf)
    with LLM(str(path), max_model_len=128, max_num_seqs=4) as llm:
        return str(path), llm.generate(prompts, PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 6])
def test_quantized_tensor_parallel_matches_one_process(quantized, prompts, world):
    path, ref = quantized
    with LLM(path, max_model_len=128, max_num_seqs=4, tensor_parallel_size=world) as llm:
        _assert_same(ref, llm.generate(prompts, PARAMS))


@pytest.mark.parametrize("world,offload", [(1, 4), (2, 3)])
def test_cpu_experts_match(ckpt, prompts, reference, world, offload):
    with LLM(ckpt, max_model_len=128, max_num_seqs=4, tensor_parallel_size=world, cpu_offload=offload) as llm:
        placement = llm.engine.expert_placement
        assert all(row.count(-1) == offload for row in placement if row)
        if world == 1:  # with 2 ranks the coldest (highest) experts belong to rank 1's range
            host = llm.engine.model.model.layers[1].mlp.experts.host
            assert host is not None and host.w13_weight.device.type == "cpu" and host.num == offload
        _assert_same(reference, llm.generate(prompts, PARAMS))
        stats = llm.engine.routing_stats()
        assert sum(stats[1]) > 0


def test_routing_stats_round_trip_to_hottest_first_placement(ckpt, prompts, tmp_path):
    path = tmp_path / "routing.json"
    with LLM(ckpt, max_model_len=128, max_num_seqs=4) as llm:
        llm.generate(prompts, PARAMS)
        llm.engine.save_routing_stats(str(path))
        stats = llm.engine.routing_stats()
    with LLM(ckpt, max_model_len=128, max_num_seqs=4, cpu_offload=3, routing_stats=str(path)) as llm:
        for layer, row in enumerate(llm.engine.expert_placement):
            if not row:
                continue
            on_host = [e for e, d in enumerate(row) if d == -1]
            coldest = sorted(range(len(row)), key=lambda e: stats[layer][e])[:3]
            assert sorted(stats[layer][e] for e in on_host) == sorted(stats[layer][e] for e in coldest)


def test_dead_worker_is_an_error_in_rank0_not_a_hang(ckpt, prompts):
    llm = LLM(ckpt, max_model_len=128, max_num_seqs=4, tensor_parallel_size=2)
    try:
        os.kill(llm.engine.workers.procs[0].pid, signal.SIGKILL)
        llm.engine.workers.procs[0].join(timeout=10)
        t = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1"):
            llm.generate(prompts, PARAMS)
        assert time.monotonic() - t < 10
    finally:
        llm.shutdown()


def test_small_memory_budget_pushes_experts_to_the_cpu_path(ckpt, prompts, reference):
    from kimitui.engine.config import ModelConfig
    from kimitui.engine.plan.param_count import count_params, kv_bytes_per_token

    config = ModelConfig.from_pretrained(ckpt)
    size = count_params(config)
    # float32 on the CPU: twice the bf16 bytes the planner counts; room for the dense part, the
    # KV cache of 4 x 128 tokens and about half of the routed experts
    non_expert = size.total.nbytes - size.parts["routed_experts"].nbytes
    budget = non_expert + 4 * 128 * kv_bytes_per_token(config) + size.parts["routed_experts"].nbytes // 2
    with LLM(ckpt, max_model_len=128, max_num_seqs=4, cpu_offload="auto", gpu_memory_gb=budget / 2**30) as llm:
        where = [d for row in llm.engine.expert_placement for d in row]
        assert where.count(-1) and where.count(0)  # some experts on the device, some in host RAM
        _assert_same(reference, llm.generate(prompts, PARAMS))
    with pytest.raises(ValueError, match="does not fit"):
        LLM(ckpt, max_model_len=128, max_num_seqs=4, cpu_offload="none", gpu_memory_gb=budget / 2**30)


def test_worker_failing_at_start_up_is_an_error_not_a_hang(ckpt, monkeypatch):
    # A worker that cannot start (here: a bad dtype name reaches only the workers) must not leave
    # rank 0 waiting for it at the rendezvous.
    from kimitui.engine.parallel import workers

    real = workers.WorkerSpec

    def broken_spec(*args, **kwargs):
        spec = real(*args, **kwargs)
        return real(**{**spec.__dict__, "dtype": "no_such_dtype"})

    monkeypatch.setattr("kimitui.engine.engine.WorkerSpec", broken_spec)
    t = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        LLM(ckpt, max_model_len=128, max_num_seqs=4, tensor_parallel_size=2)
    assert time.monotonic() - t < 60
