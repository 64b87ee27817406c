"""benchmarks/vs_vllm_cpu.py: the pieces both of its processes share (prompts, the CPU clock of a
process tree, greedy agreement), its checkpoint (our engine's loader reads it) and its argument
checks. The run against vLLM itself needs vLLM's own venv and is measured, not tested."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import vs_vllm_cpu as bench

REPO = Path(__file__).resolve().parents[2]


def test_prompts_are_the_same_in_every_call_and_inside_the_vocab():
    a, b = bench.prompts(4, 16, 1000), bench.prompts(4, 16, 1000)
    assert a == b and len(a) == 4 and all(len(p) == 16 for p in a)
    assert all(2 <= t < 1000 for p in a for t in p)
    assert a[0] != a[1]


def test_tree_cpu_seconds_counts_a_busy_child():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)",
        ]
    )
    try:
        deadline = time.time() + 30
        while bench.tree_cpu_seconds(child.pid) < 0.5 and time.time() < deadline:
            time.sleep(0.1)
        assert bench.tree_cpu_seconds(os.getpid()) >= bench.tree_cpu_seconds(child.pid) >= 0.5
    finally:
        child.kill()
        child.wait()


def test_agreement_counts_equal_requests_and_the_prefix_before_the_first_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert bench.agreement(ref, ref) == "2/2 same, 100% before first diff"
    assert bench.agreement([[1, 2, 3, 4], [5, 6, 0, 8]], ref) == "1/2 same, 75% before first diff"


def test_checkpoint_loads_in_our_engine(tmp_path):
    from kimitui.engine import LLM, SamplingParams

    config = dict(
        bench.MODEL_CONFIG,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    bench.write_checkpoint(tmp_path, config)
    bench.write_checkpoint(tmp_path, config)  # a second call reuses it
    with pytest.raises(SystemExit, match="another shape"):
        bench.write_checkpoint(tmp_path, dict(config, num_hidden_layers=3))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    out = llm.generate(
        [{"prompt_token_ids": p} for p in bench.prompts(2, 8, 256)],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    )
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "--vllm-python is required"),
        (["--no-vllm", "--concurrency", "1,x"], "comma-separated integers"),
        (["--no-vllm", "--dtypes", "float16"], "--dtypes takes"),
        (["--no-vllm", "--layers", "1"], "--layers must be >= 2"),
        (["--vllm-python", "python", "--vllm-env", "NOEQUALS"], "KEY=VALUE"),
    ],
)
def test_bad_arguments_get_a_one_line_error(argv, message):
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vs_vllm_cpu.py"), *argv], capture_output=True, text=True, cwd=REPO
    )
    assert run.returncode == 2 and message in run.stderr
