"""NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py, imported lazily)."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

from kimitui.telemetry.backend import GpuBackend, number
from kimitui.telemetry.sample import GpuSample

log = logging.getLogger(__name__)


def _milli(value: Any) -> float | None:
    value = number(value)
    return None if value is None else value / 1000


class NvmlBackend(GpuBackend):
    """Per-GPU power, energy counter, utilisation, memory and temperature from NVML.

    ``module`` replaces ``import pynvml`` (tests pass a fake). An ``NVMLError`` from one call
    (NOT_SUPPORTED on older boards, GPU_IS_LOST...) leaves that reading None.
    """

    name = "nvml"

    def __init__(self, module: ModuleType | None = None) -> None:
        super().__init__()
        self._nvml: ModuleType | None = None
        try:
            nvml = module if module is not None else importlib.import_module("pynvml")
        except Exception as exc:
            self._unavailable(f"pynvml not importable ({exc}); pip install nvidia-ml-py")
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on non-NVIDIA hosts
            self._unavailable(f"nvmlInit failed: {exc}")
            return
        self._nvml = nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:
            self.close()
            self._unavailable(f"NVML device enumeration failed: {exc}")
            return
        self._adopt(handles, "NVML found no NVIDIA GPUs")

    def close(self) -> None:
        nvml, self._nvml = self._nvml, None
        self._handles = []
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception as exc:
                log.debug("nvmlShutdown failed: %r", exc)

    def _device_name(self, index: int, handle: Any) -> str:
        name = self._call("nvmlDeviceGetName", self._nvml.nvmlDeviceGetName, handle)
        if isinstance(name, bytes):  # nvidia-ml-py < 11.515 returned bytes
            name = name.decode(errors="replace")
        return name if isinstance(name, str) and name else f"NVIDIA GPU {index}"

    def _read_gpu(self, index: int, handle: Any) -> GpuSample:
        nvml = self._nvml
        util = self._call("nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, handle)
        used = number(getattr(memory, "used", None))
        total = number(getattr(memory, "total", None))
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        return GpuSample(
            index=index,
            name=self._names[index],
            vendor="nvidia",
            # Both in milli-units: mW, and mJ since the driver loaded.
            power_w=_milli(self._call("nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, handle)),
            power_cap_w=_milli(self._call("nvmlDeviceGetEnforcedPowerLimit",
                                          nvml.nvmlDeviceGetEnforcedPowerLimit, handle)),
            energy_j=_milli(self._call("nvmlDeviceGetTotalEnergyConsumption",
                                       nvml.nvmlDeviceGetTotalEnergyConsumption, handle)),
            util_pct=number(getattr(util, "gpu", None)),
            mem_util_pct=number(getattr(util, "memory", None)),
            mem_used_bytes=None if used is None else int(used),
            mem_total_bytes=None if total is None else int(total),
            temp_c=number(self._call("nvmlDeviceGetTemperature", nvml.nvmlDeviceGetTemperature,
                                     handle, sensor)),
        )
