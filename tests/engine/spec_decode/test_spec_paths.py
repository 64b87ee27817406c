"""Speculative decoding on the other paths users run: tensor parallel over gloo ranks, experts in
host RAM, the decode graphs' static buffers, and the emulated device path (Triton kernels
interpreted); plus sampled decoding through the engine (seeded, reproducible) and a K3 soak with
aborts and preemptions that must leave no block, state slot or snapshot behind."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.runner.model_runner import ModelRunner
from tests.engine.spec_decode.scripted import ScriptedProposer
from tests.engine.spec_decode.test_spec_greedy import SPEC, _prompts, k2_path, k3_path  # noqa: F401

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _answers(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}


def _spec_tokens(llm, prompts, answers, params=GREEDY, seed=0):
    llm.engine.proposer = ScriptedProposer(answers, seed=seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["k2", "k3"])
def test_tensor_parallel_two_ranks(ckpt, k2_path, k3_path):  # noqa: F811
    path = str(k2_path if ckpt == "k2" else k3_path)
    prompts = _prompts(3, [5, 30, 12], seed=4)
    with LLM(path, max_model_len=256, max_num_seqs=4) as one:
        answers = _answers(one, prompts)
    with LLM(path, max_model_len=256, max_num_seqs=4, tensor_parallel_size=2, speculative_config=SPEC) as two:
        assert _spec_tokens(two, prompts, answers) == answers


def test_experts_in_host_ram(k2_path):  # noqa: F811
    prompts = _prompts(3, [6, 20, 9], seed=5)
    with LLM(str(k2_path), max_model_len=256, max_num_seqs=4) as ref:
        answers = _answers(ref, prompts)
    with LLM(str(k2_path), max_model_len=256, max_num_seqs=4, cpu_offload=3, speculative_config=SPEC) as llm:
        assert any(-1 in row for row in llm.engine.expert_placement if row)
        assert _spec_tokens(llm, prompts, answers) == answers


@pytest.mark.parametrize("ckpt", ["k2"])
def test_decode_graph_static_buffers(ckpt, k2_path):  # noqa: F811
    # the graphs' static-buffer path (direct calls on a CPU): a verifying decode is 1 + k rows of the
    # fixed-capacity tables, padded to a bucket like any decode batch
    prompts = _prompts(4, [5, 9, 14, 7], seed=6)
    with LLM(str(k2_path), max_model_len=256, max_num_seqs=4, enable_prefix_caching=False) as ref:
        answers = _answers(ref, prompts)
    with LLM(
        str(k2_path), max_model_len=256, max_num_seqs=4, enable_prefix_caching=False, speculative_config=SPEC
    ) as llm:
        e, r = llm.engine, llm.engine.runner
        e.runner = ModelRunner(
            r.model,
            r.kv_caches,
            r.block_size,
            r.device,
            max_num_seqs=4,
            max_model_len=256,
            decode_graphs=True,
            num_spec_tokens=4,
        )
        assert e.runner.graphs is not None and e.runner.table_shape[0] == 4 * 5
        assert _spec_tokens(llm, prompts, answers) == answers


def test_sampled_decoding_seeded_and_reproducible(k2_path):  # noqa: F811
    prompts = _prompts(3, [6, 11, 4], seed=8)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, ignore_eos=True, seed=7, logprobs=1)
    # back-off off: with it, draft lengths follow the engine's recent acceptance, which the runs below change
    with LLM(str(k2_path), max_model_len=256, max_num_seqs=4, speculative_config={**SPEC, "backoff": False}) as llm:
        ref = _answers(llm, prompts)  # the proposer drafts what a sampled run produced: many accepted
        a = _spec_tokens(llm, prompts, ref, params, seed=1)
        b = _spec_tokens(llm, prompts, ref, params, seed=1)
        assert a == b  # a seeded request's tokens depend on its seed and its drafts only
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for o in outs:
            assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) == 24


def test_k3_soak_with_aborts_and_preemption_leaks_nothing(k3_path):  # noqa: F811
    llm = LLM(str(k3_path), max_model_len=128, max_num_seqs=4, kv_cache_tokens=192, speculative_config=SPEC)
    eng = llm.engine
    rng = random.Random(0)
    prompts = _prompts(12, [40, 17, 64, 9, 33], seed=9)
    from kimitui.engine.spec_decode.ngram import NgramProposer

    eng.proposer = NgramProposer(1, 3)  # random models loop: single-token lookups get accepted
    pending = list(enumerate(prompts))
    live: set[str] = set()
    for step in range(400):
        while pending and len(live) < 6 and rng.random() < 0.5:
            i, p = pending.pop()
            rid = eng.add_request(
                f"r{i}",
                {"prompt_token_ids": p},
                SamplingParams(
                    temperature=0.0 if i % 2 else 0.7, max_tokens=rng.randrange(5, 40), ignore_eos=True, seed=i
                ),
            )
            live.add(rid)
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            eng.abort_request(victim)
            live.discard(victim)
        if not pending and not live:
            break
    assert not pending and not live and not eng.has_unfinished_requests()
    assert eng.scheduler.num_preemptions > 0 and eng.spec_stats.num_drafts > 0
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    slots = bm.state_slots
    assert slots.num_free_seq_slots == slots.max_num_seqs
    assert not slots._pending, "a snapshot write was left pending"
    assert not eng.runner._rollbacks and not eng.runner._generators
    # every held snapshot is keyed by a block that is still cached
    assert all(bm._cached.get(h) is not None for h in slots._snapshots)


# -- the emulated device path ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_emulated_device_path_identical(kind, tmp_path):
    if kind == "k3":
        from tests.helpers.k3_checkpoint import write_k3_checkpoint

        write_k3_checkpoint(tmp_path, seed=3, num_layers=4, kda_layers=(1, 2), full_attn_layers=(3, 4))
    else:
        from tests.helpers.checkpoints import write_hf_checkpoint

        write_hf_checkpoint(tmp_path, seed=11, num_hidden_layers=3)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KIMITUI_KERNELS")}
    env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.spec_decode.test_spec_paths", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1])
    assert got["backends"] == ["TritonBackend"]
    assert got["accepted"] > 0
    assert got["spec"] == got["plain"]


def _child(path: str) -> None:
    from kimitui.kernels.backend import Backend

    prompts = [[5, 17, 3, 99, 41, 7, 63], [250, 2, 8, 120]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(
        path, dtype="float16", max_model_len=64, max_num_seqs=2, enable_prefix_caching=False, speculative_config=SPEC
    )
    backends = sorted(
        {type(m.ops).__name__ for m in llm.engine.model.modules() if isinstance(getattr(m, "ops", None), Backend)}
    )
    llm.engine.proposer = None
    plain = _answers(llm, prompts, params)
    spec = _spec_tokens(llm, prompts, plain, params)
    print(
        json.dumps(
            {
                "backends": backends,
                "plain": list(plain.values()),
                "spec": list(spec.values()),
                "accepted": llm.engine.spec_stats.num_accepted_tokens,
            }
        )
    )


if __name__ == "__main__":
    _child(sys.argv[1])
