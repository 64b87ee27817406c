"""Power, utilisation and memory telemetry for AMD and NVIDIA GPUs, CPU packages and the host.

Never imports textual, the engine or other kimitui packages: the TUI and benchmarks consume it.
"""

from kimitui.telemetry.amd import AmdSmiBackend
from kimitui.telemetry.amd_energy import AmdEnergyBackend
from kimitui.telemetry.backend import Backend
from kimitui.telemetry.detect import describe_backends, detect_backends
from kimitui.telemetry.energy import EnergyWindow, energy_per_token, window_energy
from kimitui.telemetry.host import HostBackend
from kimitui.telemetry.nvidia import NvmlBackend
from kimitui.telemetry.rapl import RaplBackend
from kimitui.telemetry.sample import BackendStatus, CpuPower, GpuSample, HostStats, Sample
from kimitui.telemetry.sampler import TelemetrySampler

__all__ = [
    "AmdEnergyBackend",
    "AmdSmiBackend",
    "Backend",
    "BackendStatus",
    "CpuPower",
    "EnergyWindow",
    "GpuSample",
    "HostBackend",
    "HostStats",
    "NvmlBackend",
    "RaplBackend",
    "Sample",
    "TelemetrySampler",
    "describe_backends",
    "detect_backends",
    "energy_per_token",
    "window_energy",
]
