"""Kimi K3 with two tensor-parallel ranks (gloo) on the emulated device path, end to end, against
the plain CPU path with one rank: the same greedy tokens (issue 25's acceptance).

The emulated run (``KIMITUI_EMULATE_DEVICE=1``, ``TRITON_INTERPRET=1``, float16) takes the branches a
two-GPU run takes: Triton kernels, the workers mirroring each step, and decode-only steps through
the decode graph runner's static buffers on both ranks (with direct calls in place of the captured
graph, engine/runner/graphs.py). The child reports that both ranks' runners took that path. Tolerance
on log-probs as in test_emulated_device (fp16 against fp32).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [[5, 17, 3, 99, 41, 7, 63], [250, 2, 8, 120], [9, 9, 31]]  # 3 sequences: bucket 4, one padding row
MAX_TOKENS = 4
LOGPROB_ATOL = 0.02

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


def _run_child(path: Path, dtype: str, tp: int, emulate: bool) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "KIMITUI_EMULATE_DEVICE", "KIMITUI_KERNELS")
    }
    if emulate:
        env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1")
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.parallel.test_emulated_tp_k3", str(path), dtype, str(tp)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"child ({dtype}, tp={tp}, emulate={emulate}) failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def test_emulated_k3_on_two_ranks_matches_cpu_path(tmp_path):
    from tests.helpers.k3_checkpoint import write_k3_checkpoint

    # 4 layers: KDA, KDA, MLA, MLA; 2 KDA and 2 MLA heads, 8 MXFP4 experts: one head and 4 experts per rank
    write_k3_checkpoint(tmp_path, seed=3, num_layers=4, kda_layers=(1, 2), full_attn_layers=(3, 4))
    cpu = _run_child(tmp_path, "float32", 1, emulate=False)
    dev = _run_child(tmp_path, "float16", 2, emulate=True)
    assert cpu["graphs"] is False and dev["graphs"] is True  # rank 0 took the static-buffer decode path
    assert dev["graph_lens"][3] == dev["graph_lens"][0]  # the last step's padding row repeated row 0
    assert dev["tokens"] == cpu["tokens"], (cpu["tokens"], dev["tokens"])
    worst = max(abs(a - b) for key in ("prompt_lp", "gen_lp") for x, y in zip(cpu[key], dev[key]) for a, b in zip(x, y))
    print(f"K3 tp=2 emulated vs CPU: max |log-prob difference| {worst:.2e}")
    assert worst < LOGPROB_ATOL


def _child(path: str, dtype: str, tp: int) -> None:
    from kimitui.engine import LLM
    from tests.helpers.greedy_run import greedy_run

    llm = LLM(path, dtype=dtype, max_model_len=64, max_num_seqs=4, enable_prefix_caching=False, tensor_parallel_size=tp)
    graphs = llm.engine.runner.graphs
    record, _ = greedy_run(llm, PROMPTS, MAX_TOKENS)
    lens = graphs.lens.tolist() if graphs is not None else []
    llm.shutdown()
    print(json.dumps({**record, "graphs": graphs is not None, "graph_lens": lens}))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
