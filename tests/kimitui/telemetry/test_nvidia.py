"""NvmlBackend against a fake ``pynvml`` with NVML's names, milli-units and NVMLError."""

from __future__ import annotations

import sys
import types
from collections import namedtuple

import pytest

from kimitui.telemetry import GpuSample, NvmlBackend, visible

Utilization = namedtuple("c_nvmlUtilization_t", "gpu memory")
Memory = namedtuple("c_nvmlMemory_t", "total free used")


class NVMLError(Exception):
    _text = {3: "Not Supported", 9: "Driver Not Loaded", 12: "NVML Shared Library Not Found", 15: "GPU is lost"}

    def __init__(self, value: int) -> None:
        self.value = value

    def __str__(self) -> str:
        return self._text.get(self.value, "Unknown Error")


def make_pynvml(gpus: list[dict], init_error: Exception | None = None) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.calls = {"init": 0, "shutdown": 0}

    def answer(handle: int, key: str):
        value = gpus[handle][key]
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlInit():
        nvml.calls["init"] += 1
        if init_error is not None:
            raise init_error

    def nvmlShutdown():
        nvml.calls["shutdown"] += 1

    def nvmlDeviceGetTemperature(handle, sensor):
        assert sensor == nvml.NVML_TEMPERATURE_GPU
        return answer(handle, "temp")

    nvml.nvmlInit = nvmlInit
    nvml.nvmlShutdown = nvmlShutdown
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: answer(h, "name")
    nvml.nvmlDeviceGetPowerUsage = lambda h: answer(h, "power_mw")
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: answer(h, "energy_mj")
    nvml.nvmlDeviceGetUtilizationRates = lambda h: answer(h, "util")
    nvml.nvmlDeviceGetMemoryInfo = lambda h: answer(h, "memory")
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: answer(h, "limit_mw")
    nvml.nvmlDeviceGetTemperature = nvmlDeviceGetTemperature
    return nvml


def h200(**overrides) -> dict:
    gpu = {
        "name": "NVIDIA H200",
        "power_mw": 431_250,
        "energy_mj": 987_654_321,
        "util": Utilization(gpu=88, memory=35),
        "memory": Memory(total=150_754_820_096, free=100_000_000_000, used=50_754_820_096),
        "limit_mw": 700_000,
        "temp": 54,
    }
    gpu.update(overrides)
    return gpu


@pytest.fixture(autouse=True)
def whole_node(monkeypatch):
    """These fakes stand for the whole node: the runner's own GPU visibility must not apply."""
    for variable in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(visible, "engine_pci_bus_ids", lambda: None)


@pytest.fixture
def install(monkeypatch):
    def _install(nvml):
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        return nvml

    return _install


def test_reads_gpu_in_si_units(install):
    nvml = install(make_pynvml([h200(), h200(name=b"NVIDIA H200")]))
    backend = NvmlBackend()
    assert backend.available
    gpus = backend.read()
    assert gpus[0] == GpuSample(
        index=0,
        name="NVIDIA H200",
        vendor="nvidia",
        power_w=431.25,
        power_cap_w=700.0,
        energy_j=pytest.approx(987_654.321),
        util_pct=88.0,
        mem_util_pct=35.0,
        mem_used_bytes=50_754_820_096,
        mem_total_bytes=150_754_820_096,
        temp_c=54.0,
    )
    assert gpus[1].name == "NVIDIA H200" and gpus[1].index == 1  # old bindings return bytes
    backend.close()
    backend.close()
    assert nvml.calls == {"init": 1, "shutdown": 1}


def test_nvml_error_costs_only_its_field(install):
    install(make_pynvml([h200(energy_mj=NVMLError(3), util=NVMLError(15), temp=NVMLError(3))]))
    backend = NvmlBackend()
    gpu = backend.read()[0]
    assert gpu.energy_j is None and gpu.util_pct is None and gpu.mem_util_pct is None
    assert gpu.temp_c is None
    assert gpu.power_w == 431.25 and gpu.mem_used_bytes == 50_754_820_096
    assert "nvmlDeviceGetTotalEnergyConsumption" in backend.status().detail


def test_name_failure_falls_back(install):
    install(make_pynvml([h200(name=NVMLError(15))]))
    assert NvmlBackend().read()[0].name == "NVIDIA GPU 0"


def test_missing_module_init_failure_and_no_gpus(monkeypatch, install):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    backend = NvmlBackend()
    assert not backend.available and "nvidia-ml-py" in backend.error

    install(make_pynvml([], init_error=NVMLError(12)))
    backend = NvmlBackend()
    assert not backend.available and "Library Not Found" in backend.error

    nvml = install(make_pynvml([]))
    backend = NvmlBackend()
    assert not backend.available and "no NVIDIA GPUs" in backend.error
    assert nvml.calls["shutdown"] == 1
