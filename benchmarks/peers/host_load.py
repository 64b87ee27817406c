"""How much of a machine's CPU time other processes took while a benchmark ran; the CPU a benchmark
names in its table, and other processes spinning on the cores (``Busy``, a contention run).

The load average cannot say: a side-by-side benchmark's own engines keep it near their thread count,
so it reads "busy" on a quiet machine. Here the machine's busy CPU time over the run (/proc/stat)
less this process tree's own (this process, its live descendants, and the children it has reaped)
is the other processes' share. Linux only; elsewhere ``others_share`` is None.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0  # another VM's, not a process here
    return (sum(fields[:8]) - idle - steal) / _HZ


def _rusage_seconds() -> float:
    """CPU seconds of this process and of the children it has reaped."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _live_seconds() -> dict[int, float]:
    """CPU seconds so far of each live descendant."""
    live = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            live[p.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return live


class OtherLoad:
    """``start()`` then ``others_share()``: the other processes' CPU time over the wall time times the
    CPU count, 0.0 (nothing else ran) to 1.0 (they had every CPU)."""

    def start(self) -> OtherLoad:
        self._wall, self._busy = time.monotonic(), _busy_seconds()
        self._own, self._live = _rusage_seconds(), _live_seconds()
        return self

    def others_share(self) -> float | None:
        if self._busy is None:
            return None
        busy, own, live = _busy_seconds(), _rusage_seconds(), _live_seconds()
        # a child reaped since the start brought its whole life's time into RUSAGE_CHILDREN: less what
        # it had before the start; one still alive counts what it used since
        own_time = (own - self._own) - sum(t for pid, t in self._live.items() if pid not in live)
        own_time += sum(t - self._live.get(pid, 0.0) for pid, t in live.items())
        wall = time.monotonic() - self._wall
        return max(0.0, min(1.0, (busy - self._busy - own_time) / max(wall * (os.cpu_count() or 1), 1e-9)))


def cpu_description() -> str:
    model, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "?":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    isa = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8") if f in flags
    ]
    return f"{model}, {os.cpu_count()} logical CPUs, {' '.join(isa) or 'no avx2'}"


class Busy:
    """``n`` processes spinning on the cores (another job on the machine)."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
            p.wait()
