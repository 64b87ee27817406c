"""Verification steps of a Kimi K3 target with drafting on, replayed from decode graphs on the emulated
device (engine/runner/verify_graphs.py): the same logits, MLA caches and KDA states (sequence slots
and the scratch slots the rollback reads) as the eager verification path, over several speculative
steps with rejected drafts, state rollbacks, sequences with fewer drafts than the bucket's width
(padding positions) and buckets with padding sequences.

The child (``KIMITUI_EMULATE_DEVICE=1 TRITON_INTERPRET=1``: the Triton kernels a GPU runs) builds two
runners over the same model: eager, and graphed with emulated capture (``EmulatedGraph``: a replay
re-issues the recorded kernels on the same memory without the Python, so anything the capture froze
that should vary per step shows up as a difference). Each keeps its own caches (snapshots swapped in
before its step), so the graphed trajectory runs on its own results. Launch counts per step (eager op
by op; graphed: the launches outside the graph plus one per replay) come back too.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.engine.runner.graphs.test_graph_padding_rows import restore, run_child, snapshot

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.slow,  # about 90 s under the Triton interpreter
]

K = 3  # drafts per sequence at most: width 4
MAX_SEQS = 4  # sequence buckets 1, 2, 4
BLOCK = 16
SLOTS = [2, 0, 3]  # three sequences' KDA slots
START = [20, 9, 30]  # their context lengths before the first step
# per step: rows per sequence (1 + drafts; None: not in the step) and drafts accepted afterwards
STEPS = [
    ([4, 2, 1], [1, 1, 0]),  # bucket 4: a padding sequence; B and C pad positions
    ([4, 4, 4], [3, 0, 2]),  # full width; B rejects everything
    ([2, None, 3], [0, None, 2]),  # two sequences: bucket 2, no padding sequence
    ([4, 1, 4], [2, 0, 1]),
]


def test_k3_verify_steps_replayed_from_graphs_match_eager(tmp_path):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    write_k3_checkpoint(tmp_path, seed=3, num_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,))
    got = run_child("tests.engine.runner.graphs.test_graph_verify_k3", str(tmp_path))
    print(json.dumps(got))
    assert got["verify_buckets"] == [2, 4] and got["graph_steps"] == len(STEPS), got
    for i, step in enumerate(got["steps"]):
        assert step["replays"] == 1, (i, step)  # the whole forward is one graph launch
        assert step["logits"] < 2e-2, (i, step)
        assert step["mla_cache"] < 1e-2, (i, step)
        assert step["kda_state"] < 1e-2, (i, step)
        assert step["graphed_launches"] < step["eager_launches"] / 3, (i, step)


# -- child --------------------------------------------------------------------------------------


def _inputs(lens: list, ctx: list, ids_base: int, restores: list):
    from kimitui.engine.runner.model_runner import StepInputs

    inp = StepInputs([], 0, [], [], [], [])
    for i, n in enumerate(lens):
        if n is None:
            continue
        table = [i * 4 + j for j in range(-(-(ctx[i] + K + 1) // BLOCK))]
        row = len(inp.ids)
        inp.ids += [ids_base + 7 * i + j for j in range(n)]
        inp.decode_tables += [table] * n
        inp.decode_lens += list(range(ctx[i] + 1, ctx[i] + n + 1))
        inp.sample_rows += list(range(row, row + n))
        inp.state_slots += [SLOTS[i]] * n
        inp.spec_lens.append(n)
    inp.num_decodes = len(inp.ids)
    inp.state_restores = list(restores)
    return inp


def _diff(a_snap, b_snap, kinds) -> dict:
    out = {"mla_cache": 0.0, "kda_state": 0.0}
    for kind, a, b in zip(kinds, a_snap, b_snap):
        key = "kda_state" if kind == "kda" else "mla_cache"
        out[key] = max(out[key], float((a.float() - b.float()).abs().max()))
    return out


def _child(path: str) -> None:
    import torch

    from kimitui.engine import LLM
    from kimitui.engine.kv_cache.state import KDAState
    from kimitui.engine.runner.graphs import bucket_for
    from kimitui.engine.runner.model_runner import ModelRunner
    from kimitui.engine.runner.verify_graphs import VerifyGraphRunner
    from kimitui.kernels.launch_count import count_launches

    spec = {"method": "ngram", "num_speculative_tokens": K, "backoff": False}
    llm = LLM(
        path,
        dtype="float16",
        max_model_len=64,
        max_num_seqs=MAX_SEQS,
        enable_prefix_caching=False,
        kv_cache_tokens=512,
        speculative_config=spec,
    )
    base = llm.engine.runner
    kw = dict(max_num_seqs=MAX_SEQS, max_model_len=64, num_spec_tokens=K, spec_scratch_base=base.spec_scratch_base)
    eager = ModelRunner(base.model, base.kv_caches, base.block_size, base.device, decode_graphs=False, **kw)
    graphed = ModelRunner(
        base.model, base.kv_caches, base.block_size, base.device, decode_graphs=True, emulate_graphs=True, **kw
    )
    vg = graphed.verify_graphs
    assert isinstance(vg, VerifyGraphRunner) and vg.captures
    caches = base.kv_caches
    kinds = [k for c in caches for k in (["kda", "kda"] if isinstance(c, KDAState) else ["mla"])]
    torch.manual_seed(0)
    for c in caches:  # sequences mid-way: every slot and cache row holds something
        for t in [c.recurrent, c.conv] if isinstance(c, KDAState) else [c]:
            t.normal_(std=0.3)
    state = {"eager": snapshot(caches), "graphed": snapshot(caches)}
    ctx, restores, steps, graph_steps = list(START), [], [], 0
    real = VerifyGraphRunner.run_verify

    def counted(self, *a, **k):
        nonlocal graph_steps
        graph_steps += 1
        return real(self, *a, **k)

    VerifyGraphRunner.run_verify = counted
    for s, (lens, accepted) in enumerate(STEPS):
        inp = _inputs(lens, ctx, 11 + 13 * s, restores)
        n_seq = sum(n is not None for n in lens)
        if bucket_for(n_seq, vg.seq_buckets) * vg.width not in vg._graphs:
            # lazy capture: the first step of a bucket records it (warm-ups, capture, replay); that
            # step runs once before, from the eager state, so the counts below are of a replay
            for runner in (eager, graphed):
                restore(caches, state["eager"])
                runner.forward_step(_inputs(lens, ctx, 11, restores))
            graph_steps -= 1
        out = {}
        for name, runner in (("eager", eager), ("graphed", graphed)):
            restore(caches, state[name])
            with count_launches() as counts:
                logits, _ = runner.forward_step(inp)
            out[name] = (logits.float().clone(), counts)
            state[name] = snapshot(caches)
        d = _diff(state["graphed"], state["eager"], kinds)
        d["logits"] = float((out["graphed"][0] - out["eager"][0]).abs().max())
        d["eager_launches"] = out["eager"][1].launches
        d["graphed_launches"] = out["graphed"][1].launches
        d["replays"] = sum(out["graphed"][1].graphs.values())
        d["rows"] = len(inp.ids)
        steps.append(d)
        # the runner's rollback for the next step: the state after the last accepted position
        restores = []
        for i, (n, a) in enumerate(zip(lens, accepted)):
            if n is None:
                continue
            if a < n - 1:
                restores.append((base.spec_scratch_base + SLOTS[i] * K + a, SLOTS[i]))
            ctx[i] += a + 1
    VerifyGraphRunner.run_verify = real
    print(
        json.dumps(
            {"steps": steps, "graph_steps": graph_steps, "verify_buckets": sorted(b // vg.width for b in vg._graphs)}
        )
    )
    llm.shutdown()


if __name__ == "__main__":
    _child(sys.argv[1])
