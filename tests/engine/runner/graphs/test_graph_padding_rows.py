"""Padding rows of a decode graph write nothing, on the emulated device path (Kimi K3, demo-k3 layout).

A decode graph runs a bucket of ``b`` rows for ``n <= b`` sequences (engine/runner/graphs.py). Five
sequences in bucket 8 leave three padding rows. Before, every padding row named the one spare KDA
slot and row 0's newest MLA cache slot: under the Triton interpreter (programs one after another, as
a GPU may order them) the second padding row read the state the first had just written, so its
hidden state diverged and its latent landed in row 0's cache slot, wrong for the rest of that
sequence's life (issue 38, finding 1). Now padding rows carry slot -1 for both, which every cache
write skips.

The child (``KIMITUI_EMULATE_DEVICE=1 TRITON_INTERPRET=1``: the Triton kernels a GPU runs, the decode
graph runner's static buffers) runs one decode step of five sequences eagerly and through the graph
runner from the same caches, and reports the largest differences of logits, of every KDA state's
real slots, of every MLA cache and of row 0's newest MLA slot.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
MAX_SEQS = 8  # buckets 1, 2, 4, 8
LENS = [20, 5, 40, 17, 33]  # five decodes: bucket 8, three padding rows
SLOTS = [2, 5, 1, 7, 0]
BLOCK = 16

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_child(module: str, *args: str, timeout: int = 600) -> dict:
    """Run ``python -m module args`` on the emulated device path; its last stdout line as JSON."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "KIMITUI_EMULATE_DEVICE", "KIMITUI_KERNELS")
    }
    env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"child {module} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def test_k3_padding_rows_leave_caches_and_logits_as_eager(tmp_path):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    # demo-k3's layout: KDA layers 1-3, then MLA layer 4 (which reads what the KDA layers computed)
    write_k3_checkpoint(tmp_path, seed=3, num_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,))
    got = run_child("tests.engine.runner.graphs.test_graph_padding_rows", str(tmp_path))
    assert got["graphs"] and got["bucket"] == MAX_SEQS and got["padding_rows"] == 3
    print(json.dumps(got))
    assert got["row0_newest_slot"] < 1e-3, got  # row 0's own latent, not a padding row's
    assert got["mla_cache"] < 1e-3, got
    assert got["kda_state"] < 1e-3, got
    assert got["logits"] < 1e-2, got
    assert got["padding_slot_mapping"] == [-1, -1, -1] and got["padding_state_slots"] == [-1, -1, -1]


# -- child --------------------------------------------------------------------------------------


def step_inputs(ids: list[int]):
    from kimitui.engine.runner.model_runner import StepInputs

    tables = [[i * 4 + j for j in range(-(-n // BLOCK))] for i, n in enumerate(LENS)]
    return StepInputs(
        ids=ids,
        num_decodes=len(ids),
        decode_tables=tables,
        decode_lens=list(LENS),
        prefills=[],
        sample_rows=list(range(len(ids))),
        state_slots=list(SLOTS),
    )


def snapshot(caches) -> list:
    from kimitui.engine.kv_cache.state import KDAState

    out = []
    for c in caches:
        out += [c.recurrent.clone(), c.conv.clone()] if isinstance(c, KDAState) else [c.clone()]
    return out


def restore(caches, snap) -> None:
    from kimitui.engine.kv_cache.state import KDAState

    it = iter(snap)
    for c in caches:
        for t in [c.recurrent, c.conv] if isinstance(c, KDAState) else [c]:
            t.copy_(next(it))


def _child(path: str) -> None:
    import torch

    from kimitui.engine import LLM
    from kimitui.engine.kv_cache.state import KDAState
    from kimitui.engine.runner.model_runner import ModelRunner

    llm = LLM(
        path, dtype="float16", max_model_len=64, max_num_seqs=MAX_SEQS, enable_prefix_caching=False, kv_cache_tokens=512
    )
    graphed = llm.engine.runner
    eager = ModelRunner(
        graphed.model,
        graphed.kv_caches,
        graphed.block_size,
        graphed.device,
        max_num_seqs=MAX_SEQS,
        max_model_len=64,
        decode_graphs=False,
    )
    caches = graphed.kv_caches
    torch.manual_seed(0)
    for c in caches:  # sequences mid-way: every slot and cache row holds something
        for t in [c.recurrent, c.conv] if isinstance(c, KDAState) else [c]:
            t.normal_(std=0.3)
    real_slots = min(c.num_slots for c in caches if isinstance(c, KDAState))
    real_slots = min(real_slots, MAX_SEQS)
    before = snapshot(caches)
    ids = [11, 12, 13, 14, 15]
    want, _ = eager.forward_step(step_inputs(ids))
    want_caches = snapshot(caches)
    restore(caches, before)
    got, _ = graphed.forward_step(step_inputs(ids))
    got_caches = snapshot(caches)
    g = graphed.graphs
    meta = g._metadata(MAX_SEQS)
    kinds = [k for c in caches for k in (["kda", "kda"] if isinstance(c, KDAState) else ["mla"])]
    blk, off = divmod(LENS[0] - 1, BLOCK)  # row 0's newest token: its table's block blk (block id blk), offset off
    diffs = {"mla_cache": 0.0, "kda_state": 0.0, "row0_newest_slot": 0.0}
    for kind, a, b in zip(kinds, got_caches, want_caches):
        if kind == "kda":  # the real slots (a padding slot, if any, is no sequence's)
            diffs["kda_state"] = max(diffs["kda_state"], float((a[:real_slots] - b[:real_slots]).abs().max()))
        else:  # an MLA latent cache [blocks, block_size, r + rope]
            diffs["mla_cache"] = max(diffs["mla_cache"], float((a.float() - b.float()).abs().max()))
            row0 = a[blk, off].float() - b[blk, off].float()
            diffs["row0_newest_slot"] = max(diffs["row0_newest_slot"], float(row0.abs().max()))
    print(
        json.dumps(
            {
                **diffs,
                "logits": float((got - want).abs().max()),
                "graphs": g is not None,
                "bucket": MAX_SEQS,
                "padding_rows": MAX_SEQS - len(ids),
                "padding_slot_mapping": meta.slot_mapping[len(ids) :].tolist(),
                "padding_state_slots": meta.state_slots[len(ids) :].tolist() if meta.state_slots is not None else None,
            }
        )
    )
    llm.shutdown()


if __name__ == "__main__":
    _child(sys.argv[1])
