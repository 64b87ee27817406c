"""AMD GPUs through ROCm's ``amdsmi`` Python bindings (imported lazily: ROCm is optional)."""

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

_MIB = 1024 * 1024
# amdsmi_get_power_cap_info reports µW on current ROCm but W on some releases; no real GPU
# cap reaches 10 kW, and no µW cap is below 10 mW.
_MICROWATT_THRESHOLD = 10_000


def _as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _first_number(info: dict, *keys: str) -> float | None:
    for key in keys:
        value = number(info.get(key))
        if value is not None:
            return value
    return None


class AmdSmiBackend(GpuBackend):
    """Per-GPU power, energy counter, activity, VRAM and temperature from amdsmi.

    ``module`` replaces ``import amdsmi`` (tests pass a fake). One failing library call leaves
    that reading None for that GPU; the other readings still come through.
    Only the engine's GPUs are read, in HIP's order: ``ROCR_VISIBLE_DEVICES`` first, then
    ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``, which HIP also honours) indexing into
    what it left, then the first ``gpus`` (all when None).
    """

    name = "amdsmi"

    def __init__(self, module: ModuleType | None = None, gpus: int | None = None) -> None:
        super().__init__()
        self._smi: ModuleType | None = None
        try:
            smi = module if module is not None else importlib.import_module("amdsmi")
        except Exception as exc:  # ImportError, or OSError when libamd_smi.so is missing
            self._unavailable(f"amdsmi not importable ({exc}); install ROCm and its amdsmi package")
            return
        try:
            smi.amdsmi_init()
        except Exception as exc:
            self._unavailable(f"amdsmi_init failed: {exc}")
            return
        self._smi = smi
        try:
            handles = list(smi.amdsmi_get_processor_handles())
        except Exception as exc:
            self.close()
            self._unavailable(f"amdsmi_get_processor_handles failed: {exc}")
            return
        chosen = visible.first(self._engine_handles(handles), gpus, "HIP_VISIBLE_DEVICES")
        self._adopt(
            chosen,
            "amdsmi found no AMD GPUs"
            if not handles
            else "none of amdsmi's GPUs is visible to the engine (ROCR/HIP_VISIBLE_DEVICES)",
        )

    def _engine_handles(self, handles: list[Any]) -> list[Any]:
        """The GPUs HIP shows the engine, in HIP's order."""
        smi = self._smi
        bus_ids = visible.engine_pci_bus_ids()
        if bus_ids:
            try:
                # torch has already applied the visibility variables.
                return [
                    smi.amdsmi_get_processor_handle_from_bdf(f"{d:04x}:{b:02x}:{dev:02x}.0") for d, b, dev in bus_ids
                ]
            except Exception as exc:
                log.debug("amdsmi_get_processor_handle_from_bdf failed: %r", exc)
        # amdsmi's handle order is its own; HIP numbers GPUs by hip_id (its order with no
        # visibility variable set), which follows the PCI bus order (BDF) when unreported.
        enumeration = {id(h): _as_dict(self._optional("amdsmi_get_gpu_enumeration_info", h)) for h in handles}
        hip_ids = [number(enumeration[id(h)].get("hip_id")) for h in handles]
        if all(i is not None for i in hip_ids) and len(set(hip_ids)) == len(hip_ids):
            ordered = [h for _, h in sorted(zip(hip_ids, handles), key=lambda pair: pair[0])]
        else:
            bdfs = [self._optional("amdsmi_get_gpu_device_bdf", h) for h in handles]
            ordered = handles if None in bdfs else [h for _, h in sorted(zip(bdfs, handles), key=lambda pair: pair[0])]

        def uuid_of(handle: Any) -> str | None:
            uuid = enumeration[id(handle)].get("hip_uuid")
            return uuid if isinstance(uuid, str) else None

        rocr = visible.select(visible.visible_tokens("ROCR_VISIBLE_DEVICES"), ordered, "ROCR_VISIBLE_DEVICES", uuid_of)
        variable = "HIP_VISIBLE_DEVICES" if "HIP_VISIBLE_DEVICES" in os.environ else "CUDA_VISIBLE_DEVICES"
        return visible.select(visible.visible_tokens(variable), rocr, variable, uuid_of)

    def _optional(self, function: str, handle: Any) -> Any:
        """A call that older ROCm releases lack (enumeration info came with ROCm 6.4): None then."""
        fn = getattr(self._smi, function, None)
        return None if fn is None else self._call(function, fn, handle)

    def close(self) -> None:
        smi, self._smi = self._smi, None
        self._handles = []
        if smi is not None:
            try:
                smi.amdsmi_shut_down()
            except Exception as exc:
                log.debug("amdsmi_shut_down failed: %r", exc)

    def _device_name(self, index: int, handle: Any) -> str:
        smi = self._smi
        asic = _as_dict(self._call("amdsmi_get_gpu_asic_info", smi.amdsmi_get_gpu_asic_info, handle))
        name = asic.get("market_name")
        if isinstance(name, str) and name and name != "N/A":
            return name
        return f"AMD GPU {index}"

    def _read_gpu(self, index: int, handle: Any) -> GpuSample:
        smi = self._smi
        power = _as_dict(self._call("amdsmi_get_power_info", smi.amdsmi_get_power_info, handle))
        # MI300+ fill current_socket_power, Navi/MI200 average_socket_power, ROCm 7 socket_power;
        # the others read "N/A".
        power_w = _first_number(power, "current_socket_power", "socket_power", "average_socket_power")

        cap = _as_dict(self._call("amdsmi_get_power_cap_info", smi.amdsmi_get_power_cap_info, handle))
        power_cap_w = number(cap.get("power_cap"))
        if power_cap_w is not None and power_cap_w > _MICROWATT_THRESHOLD:
            power_cap_w /= 1e6

        activity = _as_dict(self._call("amdsmi_get_gpu_activity", smi.amdsmi_get_gpu_activity, handle))
        vram = _as_dict(self._call("amdsmi_get_gpu_vram_usage", smi.amdsmi_get_gpu_vram_usage, handle))
        used_mib = number(vram.get("vram_used"))
        total_mib = number(vram.get("vram_total"))

        return GpuSample(
            index=index,
            name=self._names[index],
            vendor="amd",
            power_w=power_w,
            power_cap_w=power_cap_w,
            energy_j=self._energy_j(handle),
            util_pct=number(activity.get("gfx_activity")),
            mem_util_pct=number(activity.get("umc_activity")),
            mem_used_bytes=None if used_mib is None else int(used_mib * _MIB),
            mem_total_bytes=None if total_mib is None else int(total_mib * _MIB),
            temp_c=self._temp_c(handle),
        )

    def _energy_j(self, handle: Any) -> float | None:
        smi = self._smi
        energy = _as_dict(self._call("amdsmi_get_energy_count", smi.amdsmi_get_energy_count, handle))
        # Older bindings named the accumulator "power"; the count is in counter_resolution µJ.
        ticks = _first_number(energy, "energy_accumulator", "power")
        resolution_uj = number(energy.get("counter_resolution"))
        if ticks is None or resolution_uj is None:
            return None
        return ticks * resolution_uj / 1e6

    def _temp_c(self, handle: Any) -> float | None:
        smi = self._smi
        kinds = getattr(smi, "AmdSmiTemperatureType", None)
        metrics = getattr(smi, "AmdSmiTemperatureMetric", None)
        if kinds is None or metrics is None:
            return None
        # MI300-class parts report EDGE as N/A; HOTSPOT (junction) is what they throttle on.
        for sensor in ("HOTSPOT", "EDGE"):
            kind = getattr(kinds, sensor, None)
            if kind is None:
                continue
            raw = self._call(
                f"amdsmi_get_temp_metric({sensor})", smi.amdsmi_get_temp_metric, handle, kind, metrics.CURRENT
            )
            value = number(raw)
            if value is not None and value > 0:
                # The Python docs say millidegrees while the CLI and mock backend say °C;
                # no GPU runs at 1000 °C, so a large value must be millidegrees.
                return value / 1000 if value >= 1000 else value
        return None
