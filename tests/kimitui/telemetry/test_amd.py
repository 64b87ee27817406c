"""AmdSmiBackend against a fake ``amdsmi`` module with the real names, units and failure modes."""

from __future__ import annotations

import sys
import types
from enum import IntEnum

import pytest

from kimitui.telemetry import AmdSmiBackend, GpuSample, visible

MIB = 1024 * 1024


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int, name: str = "AMDSMI_STATUS_NOT_SUPPORTED") -> None:
        self.err_code = err_code
        self.err_info = name
        super().__init__(f"Error code:\n\t{err_code} | {name}")

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    CRITICAL = 3


NOT_SUPPORTED = AmdSmiLibraryException(2)


def make_amdsmi(gpus: list[dict], init_error: Exception | None = None) -> types.ModuleType:
    """A module shaped like ``amdsmi``; a GPU dict value that is an exception is raised."""
    smi = types.ModuleType("amdsmi")
    smi.AmdSmiException = AmdSmiException
    smi.AmdSmiLibraryException = AmdSmiLibraryException
    smi.AmdSmiTemperatureType = AmdSmiTemperatureType
    smi.AmdSmiTemperatureMetric = AmdSmiTemperatureMetric
    smi.calls = {"init": 0, "shut_down": 0}

    def answer(handle: int, key: str):
        value = gpus[handle][key]
        if isinstance(value, Exception):
            raise value
        return value

    def amdsmi_init(flag=None):
        smi.calls["init"] += 1
        if init_error is not None:
            raise init_error

    def amdsmi_shut_down():
        smi.calls["shut_down"] += 1

    def amdsmi_get_temp_metric(handle, sensor, metric):
        assert metric == AmdSmiTemperatureMetric.CURRENT
        value = gpus[handle]["temp"][AmdSmiTemperatureType(sensor).name]
        if isinstance(value, Exception):
            raise value
        return value

    smi.amdsmi_init = amdsmi_init
    smi.amdsmi_shut_down = amdsmi_shut_down
    smi.amdsmi_get_processor_handles = lambda: list(range(len(gpus)))
    smi.amdsmi_get_gpu_asic_info = lambda h: answer(h, "asic")
    smi.amdsmi_get_power_info = lambda h: answer(h, "power")
    smi.amdsmi_get_power_cap_info = lambda h: answer(h, "cap")
    smi.amdsmi_get_energy_count = lambda h: answer(h, "energy")
    smi.amdsmi_get_gpu_activity = lambda h: answer(h, "activity")
    smi.amdsmi_get_gpu_vram_usage = lambda h: answer(h, "vram")
    smi.amdsmi_get_temp_metric = amdsmi_get_temp_metric
    return smi


def mi355x(**overrides) -> dict:
    gpu = {
        "asic": {"market_name": "AMD Instinct MI355X", "device_id": "0x75a3"},
        # MI300+: current_socket_power set, average N/A; power_cap in µW.
        "power": {
            "current_socket_power": 512,
            "average_socket_power": "N/A",
            "socket_power": 512,
            "gfx_voltage": "N/A",
            "power_limit": 1400,
        },
        "cap": {"power_cap": 1_400_000_000, "default_power_cap": 1_400_000_000, "dpm_cap": 2400},
        "energy": {"energy_accumulator": 1_000_000, "counter_resolution": 15.3, "timestamp": 123},
        "activity": {"gfx_activity": 97, "umc_activity": 41, "mm_activity": "N/A"},
        "vram": {"vram_total": 294_896, "vram_used": 1024},
        "temp": {"HOTSPOT": 61, "EDGE": "N/A"},
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
    def _install(smi):
        monkeypatch.setitem(sys.modules, "amdsmi", smi)
        return smi

    return _install


def test_reads_mi300_class_gpu_in_si_units(install):
    smi = install(make_amdsmi([mi355x(), mi355x()]))
    backend = AmdSmiBackend()
    assert backend.available and backend.error is None
    gpus = backend.read()
    assert len(gpus) == 2 and gpus[1].index == 1
    assert gpus[0] == GpuSample(
        index=0,
        name="AMD Instinct MI355X",
        vendor="amd",
        power_w=512.0,
        power_cap_w=1400.0,
        energy_j=pytest.approx(15.3),
        util_pct=97.0,
        mem_util_pct=41.0,
        mem_used_bytes=1024 * MIB,
        mem_total_bytes=294_896 * MIB,
        temp_c=61.0,
    )
    assert "2 GPU(s): AMD Instinct MI355X" in backend.status().detail
    backend.close()
    backend.close()
    assert smi.calls == {"init": 1, "shut_down": 1}


def test_older_gpu_average_power_watt_cap_old_energy_key_edge_fallback(install):
    old = mi355x(
        asic={"market_name": "N/A"},
        power={"current_socket_power": "N/A", "average_socket_power": 250, "power_limit": 300},
        cap={"power_cap": 300},  # some releases report W, not µW
        energy={"power": 2_000_000, "counter_resolution": 15.3, "timestamp": 1},  # pre-rename key
        temp={"HOTSPOT": NOT_SUPPORTED, "EDGE": 45},
    )
    install(make_amdsmi([old]))
    gpu = AmdSmiBackend().read()[0]
    assert gpu.name == "AMD GPU 0"
    assert gpu.power_w == 250.0
    assert gpu.power_cap_w == 300.0
    assert gpu.energy_j == pytest.approx(30.6)
    assert gpu.temp_c == 45.0


def test_each_failing_call_costs_only_its_field(install):
    broken = mi355x(
        power={"current_socket_power": "N/A", "average_socket_power": "N/A", "socket_power": "N/A"},
        energy=NOT_SUPPORTED,
        activity=AmdSmiLibraryException(5, "AMDSMI_STATUS_NO_PERM"),
        vram={"vram_total": "N/A", "vram_used": "N/A"},
        temp={"HOTSPOT": NOT_SUPPORTED, "EDGE": "N/A"},
    )
    install(make_amdsmi([broken, mi355x()]))
    backend = AmdSmiBackend()
    first, second = backend.read()
    assert (first.power_w, first.energy_j, first.util_pct, first.mem_util_pct) == (None,) * 4
    assert (first.mem_used_bytes, first.mem_total_bytes, first.temp_c) == (None,) * 3
    assert first.power_cap_w == 1400.0  # unaffected
    assert second.power_w == 512.0 and second.energy_j == pytest.approx(15.3)
    status = backend.status()
    assert status.available
    assert "amdsmi_get_energy_count" in status.detail and "amdsmi_get_gpu_activity" in status.detail


def test_sentinel_and_non_numeric_values_are_none(install):
    odd = mi355x(
        power={"current_socket_power": 0xFFFFFFFF, "socket_power": True, "average_socket_power": None},
        cap={"power_cap": "N/A"},
        energy={"energy_accumulator": 0xFFFFFFFFFFFFFFFF, "counter_resolution": 15.3},
    )
    install(make_amdsmi([odd]))
    gpu = AmdSmiBackend().read()[0]
    assert gpu.power_w is None and gpu.power_cap_w is None and gpu.energy_j is None


def test_millidegree_temperature_is_normalised(install):
    install(make_amdsmi([mi355x(temp={"HOTSPOT": 61000, "EDGE": "N/A"})]))
    assert AmdSmiBackend().read()[0].temp_c == 61.0


def test_missing_module_is_unavailable_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi -> ImportError
    backend = AmdSmiBackend()
    assert not backend.available
    assert "amdsmi" in backend.error
    assert backend.status().detail == backend.error
    backend.close()


def test_init_failure_and_no_gpus_are_unavailable(install):
    install(make_amdsmi([], init_error=AmdSmiLibraryException(9, "AMDSMI_STATUS_DRIVER_NOT_LOADED")))
    backend = AmdSmiBackend()
    assert not backend.available and "DRIVER_NOT_LOADED" in backend.error

    smi = install(make_amdsmi([]))
    backend = AmdSmiBackend()
    assert not backend.available and "no AMD GPUs" in backend.error
    assert smi.calls["shut_down"] == 1  # initialised, so released even though unused
