"""The C++ CPU kernels run without the GIL: the per-NUMA-node host-expert workers (each pinned to its
node's CPUs, engine/offload/cpu_experts.py) compute side by side, and other Python threads (the TUI,
the HTTP server) keep running during a call."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gil_release import mxfp4_experts, pair_times, routed_batch
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings

KERNELS = Path(__file__).resolve().parents[3] / "kernels" / "cpu" / "csrc"
needs_quant = pytest.mark.skipif(not cpu_quant_moe.available(), reason="the C++ extension does not build here")
needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
# bindings that make or read Python objects, so keep the GIL
KEEP_GIL = {"team_capsule", "use_team", "experts_capsules", "use_packed_experts", "kda_capsule", "use_kda_decode"}


def test_every_cpp_binding_releases_the_gil_unless_it_touches_python_objects():
    found = {}
    for src in sorted(KERNELS.glob("*.cpp")):
        text = src.read_text()
        for m in re.finditer(r'\bm\.def\(\s*"(\w+)"\s*,(.*?)(?=\bm\.def\(|\Z)', text, re.S):
            found[m.group(1) + " in " + src.name] = "NoGil()" in m.group(2) or "gil_scoped_release" in m.group(2)
    assert len(found) >= 14, f"expected the bindings of cpu_few_rows.cpp and cpu_quant_moe.cpp, found {found}"
    holding = [name for name, released in found.items() if not released and name.split()[0] not in KEEP_GIL]
    assert not holding, f"bindings that keep the GIL during the call: {holding}"


def _longest_silence(call) -> tuple[float, float]:
    """Run call() on this thread while another Python thread ticks every millisecond; -> the longest
    time without a tick while the call ran (from its start to its end), and the call's seconds. A
    kernel that keeps the GIL silences the ticker for the whole call (it can tick only in the Python
    around the kernel); one that releases it leaves gaps of a few ms, more on a loaded machine."""
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.02)
    start = time.perf_counter()
    call()
    end = time.perf_counter()
    stop.set()
    t.join()
    inside = [start] + [s for s in ticks if start < s < end] + [end]
    return max(b - a for a, b in zip(inside, inside[1:])), end - start


def _ticks_through(call) -> None:
    for attempt in range(3):
        silence, seconds = _longest_silence(call)
        if silence < 0.5 * seconds:
            return
    pytest.fail(f"no Python thread ran for {silence * 1e3:.0f} ms of a {seconds * 1e3:.0f} ms kernel call")


@needs_quant
def test_a_python_thread_keeps_ticking_during_a_packed_expert_call():
    experts = mxfp4_experts(12, 1024, 512)
    x, ids, wts = routed_batch(experts, 256)
    _ticks_through(lambda: cpu_quant_moe.moe(x, ids, wts, "mxfp4", experts, None, None, None))


@pytest.mark.skipif(not cpu_few_rows.available(), reason="the C++ extension does not build here")
def test_a_python_thread_keeps_ticking_during_a_few_row_linear():
    w = torch.empty(8192, 4096).uniform_(-1, 1)  # 128 MB: tens of ms per product
    x = torch.randn(16, 4096)
    _ticks_through(lambda: cpu_few_rows.linear(x, w))


@needs_quant
@needs_two_cpus
def test_two_pinned_threads_in_the_packed_expert_kernel_run_side_by_side():
    # Timed without the wait for a CPU (benchmarks/gil_release.py says why: this machine's other
    # sessions take their fair shares whatever our threads do); a thread blocked on the GIL is asleep,
    # so that wait is counted: a kernel that keeps the GIL gives about 2.
    experts = mxfp4_experts(8, 1024, 512)
    x, ids, wts = routed_batch(experts, 256)
    expected = cpu_quant_moe.moe(x, ids, wts, "mxfp4", experts, None, None, None)
    results = []

    def call():
        y = cpu_quant_moe.moe(x, ids, wts, "mxfp4", experts, None, None, None)
        results.append(y)
        return y

    ratios = []
    for attempt in range(6):  # the test suite's other worker shares the memory bus: more tries, same bound
        t = pair_times(call, repeats=5)
        ratios.append(round(t.net_ratio, 2))
        if t.net_ratio < 1.3:
            break
    assert all(torch.equal(y, expected) for y in results), "a concurrent call gave other bits"
    assert min(ratios) < 1.3, f"two pinned calls took {ratios} x one call (wall less the wait for a CPU)"


@pytest.mark.skipif(not cpu_few_rows.available(), reason="the C++ extension does not build here")
def test_the_dense_moe_from_two_threads_at_once_gives_each_its_own_scratch_and_the_same_bits():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(8, 64, 48, generator=g), torch.randn(8, 48, 32, generator=g)
    ops = CpuBackend(KernelSettings())
    xs = [torch.randn(12, 48, generator=g) for _ in range(2)]
    routes = [torch.rand(12, 8, generator=g).topk(3) for _ in range(2)]
    expected = [ops.moe_experts(x, ids, wts, w13, w2) for x, (wts, ids) in zip(xs, routes)]
    wrong, scratch = [0, 0], [None, None]

    def worker(i):
        for _ in range(50):
            wrong[i] += not torch.equal(ops.moe_experts(xs[i], routes[i][1], routes[i][0], w13, w2), expected[i])
        scratch[i] = ops.moe_scratch.data_ptr()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [0, 0], f"calls that gave other bits, per thread: {wrong}"
    assert scratch[0] != scratch[1] and ops.moe_scratch.data_ptr() not in scratch
