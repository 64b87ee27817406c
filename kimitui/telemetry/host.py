"""Host CPU utilisation, RAM and this process's resident memory through psutil."""

from __future__ import annotations

import importlib
from types import ModuleType

from kimitui.telemetry.backend import Backend, number
from kimitui.telemetry.sample import HostStats


class HostBackend(Backend):
    """CPU % (total and per CPU), RAM used/total and process RSS.

    ``module`` replaces ``import psutil``. CPU % is measured between consecutive reads, so the
    constructor primes psutil's counters (its first call always returns 0.0).
    """

    name = "psutil"

    def __init__(self, module: ModuleType | None = None) -> None:
        super().__init__()
        try:
            self._psutil = module if module is not None else importlib.import_module("psutil")
            self._process = self._psutil.Process()
            # psutil keeps separate "last call" state for the total and the per-CPU figures.
            self._psutil.cpu_percent(interval=None)
            self._psutil.cpu_percent(interval=None, percpu=True)
        except Exception as exc:
            self._unavailable(f"psutil unusable: {exc}")
            return
        self.available = True

    @property
    def detail(self) -> str:
        total = self._call("virtual_memory", self._psutil.virtual_memory)
        ram = f", {total.total / 2**30:.0f} GiB RAM" if total is not None else ""
        return f"{self._psutil.cpu_count()} CPUs{ram}"

    def read(self) -> HostStats:
        """Utilisation since the previous read, memory as of now."""
        ps = self._psutil
        per_cpu = self._call("cpu_percent(percpu)", ps.cpu_percent, None, True) or []
        memory = self._call("virtual_memory", ps.virtual_memory)
        rss = self._call("memory_info", self._process.memory_info)
        used = total = None
        if memory is not None:
            total = int(memory.total)
            # total - available is what cannot be reclaimed; psutil's own "used" ignores
            # reclaimable slabs and differs across kernels.
            used = int(memory.total - memory.available)
        return HostStats(
            cpu_util_pct=number(self._call("cpu_percent", ps.cpu_percent, None)),
            per_cpu_util_pct=tuple(float(p) for p in per_cpu),
            ram_used_bytes=used,
            ram_total_bytes=total,
            process_rss_bytes=None if rss is None else int(rss.rss),
        )
