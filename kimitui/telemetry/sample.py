"""Immutable telemetry records: one GPU reading, one host reading, one whole sample."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant. Every reading is None when the device or driver cannot give it.

    ``index`` counts devices per vendor (amdsmi handle order, NVML index); ``vendor`` is
    ``"amd"`` or ``"nvidia"``. ``energy_j`` is the hardware counter since driver load, so only
    differences between two samples mean anything.
    """

    index: int
    name: str
    vendor: str
    power_w: float | None = None
    power_cap_w: float | None = None
    energy_j: float | None = None
    util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temp_c: float | None = None


@dataclass(frozen=True)
class CpuPower:
    """CPU package power over the last interval and energy accumulated since the backend opened."""

    power_w: float | None = None
    energy_j: float | None = None


@dataclass(frozen=True)
class HostStats:
    """psutil view of the host: CPU utilisation, RAM, and this process's resident memory."""

    cpu_util_pct: float | None = None
    per_cpu_util_pct: tuple[float, ...] = ()
    ram_used_bytes: int | None = None
    ram_total_bytes: int | None = None
    process_rss_bytes: int | None = None


@dataclass(frozen=True)
class Sample:
    """Everything the sampler read in one tick.

    ``t`` is ``time.monotonic()`` (use it for intervals and energy windows), ``wall`` is
    ``time.time()`` (use it for display and logs).
    """

    t: float
    wall: float
    gpus: tuple[GpuSample, ...] = ()
    cpu_power_w: float | None = None
    cpu_energy_j: float | None = None
    cpu_util_pct: float | None = None
    per_cpu_util_pct: tuple[float, ...] = ()
    ram_used_bytes: int | None = None
    ram_total_bytes: int | None = None
    process_rss_bytes: int | None = None


@dataclass(frozen=True)
class BackendStatus:
    """What ``kimitui info`` prints per backend: whether it works and, if not, why."""

    name: str
    available: bool
    detail: str
