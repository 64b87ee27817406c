"""NUMA placement of host-RAM experts: topology from sysfs, the ``--numa`` policy, first-touch copies.

On a two-socket server each socket streams its own DIMMs; a thread reading the other socket's memory
goes over the inter-socket link at a fraction of local bandwidth. Decode on host experts is bandwidth
bound, so each node should compute the experts that live in its own memory (as KTransformers' NUMA
mode and llama.cpp's ``--numa distribute`` do).

Policies (``--numa``, read once into ``EngineArgs.numa``):

* ``auto`` (default): with more than one node, each layer's host experts are split across the nodes in
  contiguous slot ranges balanced by bytes (``assign_experts``); each node's share is copied into a
  fresh allocation by a thread pinned to that node's CPUs (Linux first-touch puts the pages on that
  node), and at run time one worker thread per node, pinned the same way, computes its node's experts;
  the partial sums are added. With one node (laptops, most cloud VMs) nothing changes.
* ``off``: one stack, one worker thread, no pinning (the behaviour before this module).

Threads: ``os.sched_setaffinity(0, cpus)`` pins the calling thread only. The C++ CPU kernels run their
parallel passes on a team of threads per calling thread (``kernels/cpu/csrc/cpu_team.h``), created by that
thread, so each team's threads inherit its CPU mask and each node's team stays on its node; a team
has ``at::get_num_threads()`` threads (torch's process-wide intra-op count) but at most one per CPU of
that mask. What still runs on OpenMP (a few ATen operations, BLAS in the dense experts' larger
products) starts libgomp teams from the calling thread in the same way: libgomp keeps one pool per
calling thread and its threads inherit the creator's mask (unless ``OMP_PROC_BIND`` /
``GOMP_CPU_AFFINITY`` rebind them), though at torch's full thread count. Tensor-parallel worker ranks
(``--gpus`` > 1) keep one stack.

Not measured (this project's machines have one node): the bandwidth gain on a real two-socket EPYC /
Xeon, whether the oversubscribed teams above cost anything, and whether transparent huge pages or
automatic NUMA balancing (``kernel.numa_balancing``) migrate the first-touched pages later. The
tests fake a two-node sysfs tree whose nodes share the same CPUs and check that outputs are unchanged.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

POLICIES = ("auto", "off")
SYSFS_NODES = "/sys/devices/system/node"


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]
    mem_bytes: int  # MemTotal of the node; 0 when meminfo is missing


@dataclass(frozen=True)
class NumaTopology:
    nodes: tuple[NumaNode, ...]

    @property
    def multi(self) -> bool:
        return len(self.nodes) > 1

    def summary_lines(self) -> list[str]:
        return [
            f"node {n.node}    cpus {format_cpulist(n.cpus)} ({len(n.cpus)}), {n.mem_bytes / 2**30:.1f} GiB"
            for n in self.nodes
        ]


@dataclass(frozen=True)
class NumaPolicy:
    """The ``--numa`` setting; ``split`` says whether host experts are split per node on ``topology``."""

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"numa policy must be one of {', '.join(POLICIES)}, got {self.mode!r}")

    def split(self, topology: NumaTopology) -> bool:
        return self.mode == "auto" and topology.multi


def parse_cpulist(text: str, source: str = "cpulist") -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11) (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise ValueError(f"{source}: cannot parse CPU range {part!r} in {text.strip()!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"{source}: CPU range {part!r} runs backwards")
        cpus.extend(range(lo, hi + 1))
    return tuple(cpus)


def format_cpulist(cpus: tuple[int, ...]) -> str:
    """Inverse of ``parse_cpulist`` for sorted CPUs: (0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs) or "-"


def read_topology(root: str | os.PathLike = SYSFS_NODES) -> NumaTopology:
    """Nodes with CPUs under ``root`` (``node<N>/cpulist`` and ``node<N>/meminfo``). A missing tree
    (non-Linux, containers without sysfs) reads as one node holding every CPU this process may use."""
    base = Path(root)
    nodes = []
    dirs = sorted((p for p in base.glob("node*") if re.fullmatch(r"node\d+", p.name)), key=lambda p: int(p.name[4:]))
    for d in dirs:
        cpulist = d / "cpulist"
        if not cpulist.is_file():
            continue
        cpus = parse_cpulist(cpulist.read_text(), str(cpulist))
        if not cpus:  # memory-only nodes (CXL, HBM): no threads to pin there
            continue
        nodes.append(NumaNode(int(d.name[4:]), cpus, _mem_total(d / "meminfo")))
    if not nodes:
        cpus = (
            tuple(sorted(os.sched_getaffinity(0)))
            if hasattr(os, "sched_getaffinity")
            else tuple(range(os.cpu_count() or 1))
        )
        nodes.append(NumaNode(0, cpus, 0))
    return NumaTopology(tuple(nodes))


def _mem_total(path: Path) -> int:
    # "Node 0 MemTotal:       24684084 kB"
    if not path.is_file():
        return 0
    for line in path.read_text().splitlines():
        m = re.match(r"Node \d+ MemTotal:\s+(\d+) kB", line)
        if m:
            return int(m.group(1)) * 1024
    raise ValueError(f"{path}: no 'Node N MemTotal: X kB' line")


def assign_experts(expert_bytes: list[int], num_nodes: int) -> list[tuple[int, int]]:
    """Contiguous slot ranges [start, end) per node, balanced by bytes: node n's range ends at the first
    slot where the running total reaches (n + 1) / num_nodes of all bytes. Deterministic; a node may get
    an empty range when there are fewer experts than nodes."""
    if num_nodes < 1:
        raise ValueError(f"assign_experts: num_nodes must be >= 1, got {num_nodes}")
    total = sum(expert_bytes)
    ranges, start, running = [], 0, 0
    for n in range(num_nodes):
        end = start
        target = total * (n + 1) / num_nodes
        while end < len(expert_bytes) and (n == num_nodes - 1 or running + expert_bytes[end] / 2 <= target):
            running += expert_bytes[end]
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def pin_current_thread(cpus: tuple[int, ...]) -> None:
    """Pin the calling thread (only) to ``cpus``; threads it creates afterwards inherit the mask."""
    os.sched_setaffinity(0, cpus)


def run_pinned(cpus_per_node: list[tuple[int, ...]], fns: list) -> list:
    """Run fns[i]() on a fresh thread pinned to cpus_per_node[i], all at once; -> their results."""

    def call(cpus, fn):
        pin_current_thread(cpus)
        return fn()

    with ThreadPoolExecutor(max_workers=len(fns), thread_name_prefix="kimitui-numa") as pool:
        return [f.result() for f in [pool.submit(call, c, fn) for c, fn in zip(cpus_per_node, fns)]]


def first_touch_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose pages are first written by the calling (pinned) thread."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out
