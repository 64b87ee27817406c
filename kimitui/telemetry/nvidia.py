"""NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py, imported lazily)."""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

from kimitui.telemetry import visible
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
    Only the engine's GPUs are read, in the engine's order: the first ``gpus`` (all when None) of
    those ``CUDA_VISIBLE_DEVICES`` leaves, matched by PCI bus id when torch has them open.
    """

    name = "nvml"

    def __init__(self, module: ModuleType | None = None, gpus: int | None = None) -> None:
        super().__init__()
        self._nvml: ModuleType | None = None
        self._order_note: str | None = None
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
        chosen = self._engine_handles(handles)
        self._adopt(
            visible.first(chosen, gpus, "CUDA_VISIBLE_DEVICES"),
            "NVML found no NVIDIA GPUs"
            if not handles
            else "none of NVML's GPUs is visible to the engine (CUDA_VISIBLE_DEVICES)",
        )

    def _engine_handles(self, handles: list[Any]) -> list[Any]:
        """The GPUs CUDA shows the engine, in CUDA's order."""
        nvml = self._nvml
        bus_ids = visible.engine_pci_bus_ids()
        if bus_ids:
            try:
                # torch has already applied CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER.
                return [nvml.nvmlDeviceGetHandleByPciBusId(f"{d:08X}:{b:02X}:{dev:02X}.0") for d, b, dev in bus_ids]
            except Exception as exc:
                log.debug("nvmlDeviceGetHandleByPciBusId failed: %r", exc)
        tokens = visible.visible_tokens("CUDA_VISIBLE_DEVICES")
        if tokens is not None:
            tokens = [self._mig_parent_uuid(t) if t.upper().startswith("MIG-") else t for t in tokens]
        chosen = visible.select(tokens, handles, "CUDA_VISIBLE_DEVICES", self._uuid)
        if len(chosen) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            # NVML enumerates in PCI bus order; CUDA's default order is FASTEST_FIRST. They agree
            # on nodes of one GPU model, which is what tensor parallel runs on.
            self._order_note = "GPUs taken in PCI bus order (set CUDA_DEVICE_ORDER=PCI_BUS_ID to match)"
            log.info("NVML telemetry: %s", self._order_note)
        return chosen

    def _uuid(self, handle: Any) -> str | None:
        uuid = self._call("nvmlDeviceGetUUID", self._nvml.nvmlDeviceGetUUID, handle)
        return uuid.decode(errors="replace") if isinstance(uuid, bytes) else uuid

    def _mig_parent_uuid(self, token: str) -> str:
        """A MIG instance's parent GPU UUID: power and energy are only read per whole GPU."""
        nvml = self._nvml
        try:
            mig = nvml.nvmlDeviceGetHandleByUUID(token)
            return self._uuid(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) or token
        except Exception as exc:
            log.debug("MIG device %s not resolved: %r", token, exc)
            return token

    @property
    def detail(self) -> str:
        return super().detail + (f"; {self._order_note}" if self._order_note else "")

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
            power_cap_w=_milli(
                self._call("nvmlDeviceGetEnforcedPowerLimit", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            ),
            energy_j=_milli(
                self._call("nvmlDeviceGetTotalEnergyConsumption", nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            ),
            util_pct=number(getattr(util, "gpu", None)),
            mem_util_pct=number(getattr(util, "memory", None)),
            mem_used_bytes=None if used is None else int(used),
            mem_total_bytes=None if total is None else int(total),
            temp_c=number(self._call("nvmlDeviceGetTemperature", nvml.nvmlDeviceGetTemperature, handle, sensor)),
        )
