"""The C++ kernels' thread team (kernels/cpu/csrc/cpu_team.h): one per process, shared by both extensions; its
workers sleep when the engine is idle; a forked child gets a working team of its own; and a pass gives
the same bits on it as on one thread. Each case runs in a fresh interpreter, so that the threads it
counts are the ones it started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe

REPO = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.skipif(
        not (cpu_few_rows.available() and cpu_quant_moe.available()), reason="the C++ extensions do not build here"
    ),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads from Linux's /proc"),
]

PRELUDE = """
import os, sys, time
from kimitui import engine  # noqa: F401  (the engine's OpenMP settings, as a served model has them)
import torch
from kimitui.kernels.cpu import few_rows as cpu_few_rows, quant_moe as cpu_quant_moe

torch.set_num_threads(2)

def threads():
    return set(os.listdir("/proc/self/task"))

def state(tid):
    # the field after the parenthesised name in /proc/<pid>/task/<tid>/stat
    return open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]

def pass_over_threads(seed=0):
    # a one-row product over 4 MB of weights: large enough to go to the team (kInlineBytes is 1 MiB)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    return x, w, cpu_few_rows.linear(x, w)

def packed_experts():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (4, 128, 64), dtype=torch.uint8, generator=g)
    scale = torch.full((4, 128, 4), 120, dtype=torch.uint8)
    packed2 = torch.randint(0, 256, (4, 128, 32), dtype=torch.uint8, generator=g)
    scale2 = torch.full((4, 128, 2), 120, dtype=torch.uint8)
    return cpu_quant_moe.prepare("mxfp4", packed, scale, packed2, scale2)  # (on torch's OpenMP threads)

def packed_moe(experts):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 128, generator=g)
    ids, wts = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2, generator=g)
    return cpu_quant_moe.moe(x, ids, wts, "mxfp4", experts, None, None, None)
"""


def _run(body: str, **env) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + body],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_both_extensions_run_on_one_team_whose_workers_sleep_when_idle():
    out = _run(
        """
experts = packed_experts()  # loads both extensions, hands the team over, starts torch's OpenMP threads
before = threads()
pass_over_threads()
team = threads() - before
packed_moe(experts)
packed_moe(experts)
extra = threads() - before - team
time.sleep(0.3)  # past the spin window
print(len(team), len(extra), sorted(state(t) for t in team))
""",
        KIMITUI_CPU_SPIN_US="2000",
    )
    workers, extra, states = out.split(maxsplit=2)
    assert workers == "1", out  # torch's two threads: the caller and one worker
    assert extra == "0", out  # the packed experts' passes ran on the same worker, not a team of their own
    assert states.strip() == "['S']", out  # asleep, not spinning, once the engine is idle


def test_a_pass_gives_one_threads_bits_and_a_forked_child_gets_a_team_of_its_own():
    out = _run("""
experts = packed_experts()
x, w, y2 = pass_over_threads()
torch.set_num_threads(1)
y1 = cpu_few_rows.linear(x, w)
torch.set_num_threads(2)
assert torch.equal(y1, y2), "two threads changed the bits"
pid = os.fork()
if pid == 0:  # the parent's worker does not exist here: the child's passes must still finish, and right
    ok = all(torch.equal(cpu_few_rows.linear(x, w), y1) for _ in range(20)) and packed_moe(experts).isfinite().all()
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
""")
    assert out.strip() == "0", out


def test_each_calling_thread_has_a_team_that_ends_with_it_and_fits_its_cpus():
    # As libgomp's pools: a host-experts worker thread (one per NUMA node, pinned) runs its passes on a
    # team of its own, whose threads inherit its CPU mask, at most one per CPU of it.
    out = _run(
        """
import threading
experts = packed_experts()
pass_over_threads()  # the main thread's team
before = threads()
seen = {}

def worker(pin):
    if pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    x, w, y = pass_over_threads()
    packed_moe(experts)
    seen[pin] = threads() - before - {str(threading.get_native_id())}

for pin in (False, True):
    t = threading.Thread(target=worker, args=(pin,))
    t.start(); t.join(); time.sleep(0.1)  # (the first thread's team ends before the second counts)
time.sleep(0.3)  # the exited threads' teams stop
print(len(seen[False]), len(seen[True]), len(threads() - before))
""",
        KIMITUI_CPU_SPIN_US="2000",
    )
    assert out.split() == ["1", "0", "0"], out


def test_a_decode_block_on_onednn_products_puts_spinning_workers_to_sleep():
    out = _run(
        """
from kimitui.kernels.cpu import linear as cpu_linear
from kimitui.kernels.cpu.decode_block import FfnBlockWeights
torch.randn(256, 256) @ torch.randn(256, 256)  # torch's OpenMP threads start here, not below
before = threads()
pass_over_threads()  # starts the team's worker, which then spins for the (long) spin window
(worker,) = threads() - before
time.sleep(0.05)
spinning = state(worker)
d, i = 64, 32
e = torch.empty(0)
mlp = FfnBlockWeights(
    norm=torch.ones(d), norm_eps=1e-6, gate_up=torch.randn(2 * i, d).bfloat16(), down=torch.randn(d, i).bfloat16(),
    router=e, bias=e, top_k=1, n_group=1, topk_group=1, sigmoid=True, norm_topk_prob=True, scaling=1.0, w13=e, w2=e,
)
cpu_few_rows.ffn_block(torch.randn(16, d).bfloat16(), torch.empty(0, dtype=torch.long), mlp, e)
time.sleep(0.05)
print(spinning, state(worker), cpu_linear.onednn_bf16_native())
""",
        KIMITUI_CPU_SPIN_US="2000000",
    )
    spinning, after, native = out.split()
    if native != "True":
        pytest.skip("no native oneDNN bf16 product here: the block's products run on the team")
    if spinning != "R":
        pytest.skip(f"the worker did not spin ({spinning}): the machine is crowded, workers sleep anyway")
    assert after == "S", out  # 16 bf16 rows: the block's products are oneDNN's, its team kept quiet
