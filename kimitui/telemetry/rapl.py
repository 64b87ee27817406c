"""CPU package power from the Linux powercap RAPL energy counters (Intel and AMD Zen)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kimitui.telemetry.backend import Backend
from kimitui.telemetry.sample import CpuPower

DEFAULT_POWERCAP_ROOT = "/sys/class/powercap"

_RAPL_PERMISSION_HINT = (
    "energy_uj is root-only since Linux 5.10 (CVE-2020-8694); run as root or make it readable "
    "with a udev rule or /etc/sysfs.conf 'mode class/powercap/intel-rapl:0/energy_uj = 0444'"
)


@dataclass
class _Zone:
    counter: Path  # a file holding a cumulative µJ count
    name: str
    max_range_uj: int | None
    last_uj: int


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


class RaplBackend(Backend):
    """Sum of all RAPL package domains: power over the last interval, energy since opening.

    ``root`` is the powercap sysfs directory (tests point it at a fake tree); ``clock`` is the
    time source used for ΔE/Δt. The kernel counter wraps at ``max_energy_range_uj``; the
    backend unwraps it, so ``CpuPower.energy_j`` only ever grows.
    """

    name = "rapl"
    _what = "RAPL package domain"
    _permission_hint = _RAPL_PERMISSION_HINT

    default_root = DEFAULT_POWERCAP_ROOT

    def __init__(self, root: str | Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._root = Path(self.default_root if root is None else root)
        self._clock = clock
        self._zones: list[_Zone] = []
        self._energy_j = 0.0
        try:
            self._zones = self._open_zones()
        except PermissionError as exc:
            self._unavailable(f"permission denied reading {exc.filename}: {self._permission_hint}")
            return
        except (OSError, ValueError) as exc:
            self._unavailable(f"cannot read {self._what} under {self._root}: {exc}")
            return
        if not self._zones:
            self._unavailable(f"no {self._what} under {self._root}")
            return
        self._last_t = self._clock()
        self.available = True

    @property
    def detail(self) -> str:
        return ", ".join(zone.name for zone in self._zones)

    def read(self) -> CpuPower:
        """Package power (W) since the previous read and energy (J) since the backend opened."""
        now = self._clock()
        # Read every zone before touching state, so an OSError mid-way leaves it consistent.
        readings = [_read_int(zone.counter) for zone in self._zones]
        delta_uj: int | None = 0
        for zone, uj in zip(self._zones, readings):
            step = uj - zone.last_uj
            if step < 0:
                # Wrapped; without the range we cannot tell how far, so this interval is unknown.
                step = step + zone.max_range_uj if zone.max_range_uj else None
            zone.last_uj = uj
            if step is None or delta_uj is None:
                delta_uj = None
            else:
                delta_uj += step
        dt = now - self._last_t
        self._last_t = now
        if delta_uj is None:
            return CpuPower(power_w=None, energy_j=None)
        self._energy_j += delta_uj / 1e6
        power_w = delta_uj / 1e6 / dt if dt > 0 else None
        return CpuPower(power_w=power_w, energy_j=self._energy_j)

    def _open_zones(self) -> list[_Zone]:
        zones: list[_Zone] = []
        seen: set[Path] = set()
        # Top-level zones are intel-rapl:N (also used for AMD Zen); subzones intel-rapl:N:M
        # (core, uncore, dram) are inside the package figure already, so only "package*" counts.
        for path in sorted(self._root.glob("intel-rapl:*")):
            try:
                name = (path / "name").read_text().strip()
            except OSError:
                continue
            real = path.resolve()
            if not name.startswith("package") or real in seen:
                continue
            seen.add(real)
            try:
                max_range = _read_int(path / "max_energy_range_uj")
            except (OSError, ValueError):
                max_range = None
            counter = path / "energy_uj"
            zones.append(_Zone(counter, name, max_range, _read_int(counter)))
        return zones
