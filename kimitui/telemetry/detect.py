"""Find which telemetry backends work on this machine, and describe them for ``kimitui info``."""

from __future__ import annotations

from typing import Sequence

from kimitui.telemetry.amd import AmdSmiBackend
from kimitui.telemetry.amd_energy import AmdEnergyBackend
from kimitui.telemetry.backend import Backend
from kimitui.telemetry.host import HostBackend
from kimitui.telemetry.nvidia import NvmlBackend
from kimitui.telemetry.rapl import RaplBackend


def detect_backends(
    powercap_root: str | None = None, hwmon_root: str | None = None, gpus: int | None = None
) -> list[Backend]:
    """Every backend, constructed; unavailable ones carry ``error`` and are skipped when sampling.

    The GPU backends read the GPUs the engine sees (``*_VISIBLE_DEVICES``), only the first
    ``gpus`` of them when given (``--gpus N``).

    CPU power comes from RAPL when readable; ``amd_energy`` is only a fallback for it.
    """
    rapl = RaplBackend(powercap_root)
    backends: list[Backend] = [AmdSmiBackend(gpus=gpus), NvmlBackend(gpus=gpus), rapl]
    if not rapl.available:
        backends.append(AmdEnergyBackend(hwmon_root))
    return backends + [HostBackend()]


def describe_backends(backends: Sequence[Backend] | None = None) -> list[str]:
    """Printable lines, one per backend: name, ok or n/a, and what it sees or why it is missing.

    With ``backends=None`` the backends are detected for the occasion and closed again.
    """
    owned = backends is None
    chosen = detect_backends() if owned else list(backends)
    try:
        statuses = [backend.status() for backend in chosen]
    finally:
        if owned:
            for backend in chosen:
                backend.close()
    width = max((len(s.name) for s in statuses), default=0)
    return [f"{s.name:<{width}}  {'ok' if s.available else 'n/a':<3}  {s.detail}" for s in statuses]
