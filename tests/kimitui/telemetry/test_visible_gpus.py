"""GPU telemetry reads only the engine's GPUs, in the engine's order (8-GPU fake amdsmi / NVML).

GPU ``i`` of the fake node draws ``100 + i`` W, so a reading names the GPU it came from.
"""

from __future__ import annotations

import logging
import sys

import pytest

from kimitui.telemetry import AmdSmiBackend, NvmlBackend, TelemetrySampler, visible
from tests.kimitui.telemetry.test_amd import make_amdsmi, mi355x
from tests.kimitui.telemetry.test_nvidia import NVMLError, h200, make_pynvml

NODE = 8
VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def nvml_uuid(i: int) -> str:
    return f"GPU-{i:x}{i:x}a1b2c3-0000-1111-2222-33334444555{i}"


def fake_nvml_node():
    """NVML with 8 H200s in PCI bus order, UUIDs, PCI bus ids and one MIG instance on GPU 6."""
    nvml = make_pynvml([h200(power_mw=(100 + i) * 1000) for i in range(NODE)])
    bus_ids = {f"00000000:{0x10 + i:02X}:00.0": i for i in range(NODE)}

    def by_bus_id(bus_id: str) -> int:
        if bus_id not in bus_ids:
            raise NVMLError(13)
        return bus_ids[bus_id]

    def by_uuid(uuid: str):
        if uuid == "MIG-aaaa-bbbb":
            return ("mig", 6)
        raise NVMLError(13)

    nvml.nvmlDeviceGetUUID = lambda h: nvml_uuid(h)
    nvml.nvmlDeviceGetHandleByPciBusId = by_bus_id
    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda mig: mig[1]
    return nvml


def fake_amd_node():
    """amdsmi listing 8 MI355X in an order of its own: handle h is HIP device ``hip_of[h]``."""
    hip_of = [3, 0, 7, 1, 6, 2, 5, 4]
    gpus = []
    for handle, hip in enumerate(hip_of):
        gpus.append(mi355x(power={"current_socket_power": 100 + hip}))
    smi = make_amdsmi(gpus)
    smi.hip_of = hip_of
    smi.amdsmi_get_gpu_enumeration_info = lambda h: {
        "drm_render": 128 + hip_of[h],
        "drm_card": hip_of[h],
        "hsa_id": hip_of[h] + 1,
        "hip_id": hip_of[h],
        "hip_uuid": f"GPU-{hip_of[h]}{hip_of[h]}c0ffee",
        "oam_id": hip_of[h],
    }
    smi.amdsmi_get_gpu_device_bdf = lambda h: f"0000:{0x10 + hip_of[h]:02x}:00.0"
    smi.amdsmi_get_processor_handle_from_bdf = lambda bdf: hip_of.index(int(bdf[5:7], 16) - 0x10)
    return smi


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(visible, "engine_pci_bus_ids", lambda: None)


@pytest.fixture
def nvml(monkeypatch):
    module = fake_nvml_node()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture
def smi(monkeypatch):
    module = fake_amd_node()
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    return module


def watts(backend) -> list[float]:
    return [gpu.power_w for gpu in backend.read()]


# --- NVML ---------------------------------------------------------------------------------------


def test_nvml_unset_reads_all_eight(nvml):
    assert watts(NvmlBackend()) == [100.0 + i for i in range(NODE)]


@pytest.mark.parametrize("value, expected", [("0,1", [100, 101]), ("5,2", [105, 102]), ("", [])])
def test_nvml_visible_indices_in_that_order(nvml, monkeypatch, value, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    backend = NvmlBackend()
    gpus = backend.read() if backend.available else ()
    assert [g.power_w for g in gpus] == expected
    assert [g.index for g in gpus] == list(range(len(expected)))  # the engine's cuda:N numbering
    assert sum(g.power_w for g in gpus) == sum(expected)
    if not expected:
        assert "CUDA_VISIBLE_DEVICES" in backend.error


def test_nvml_uuid_prefixes_and_mig(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{nvml_uuid(3)[:8]}, MIG-aaaa-bbbb,{nvml_uuid(1)}")
    assert watts(NvmlBackend()) == [103.0, 106.0, 101.0]


def test_nvml_bad_entries_warn_and_are_left_out(nvml, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,9,GPU-nope,1")
    with caplog.at_level(logging.WARNING):
        backend = NvmlBackend()
    assert watts(backend) == [101.0]
    text = caplog.text
    assert "index 9 is out of range (8 GPU(s) there)" in text and "CUDA_VISIBLE_DEVICES" in text
    assert "'GPU-nope'" in text and "twice" in text


def test_nvml_pci_order_is_said_unless_cuda_device_order_says_it(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert "PCI bus order" in NvmlBackend().status().detail
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert "PCI bus order" not in NvmlBackend().status().detail


def test_nvml_torch_bus_ids_win_over_the_variable(nvml, monkeypatch):
    # torch saw (FASTEST_FIRST) PCI buses 0x17 then 0x12 as cuda:0 and cuda:1.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(visible, "engine_pci_bus_ids", lambda: [(0, 0x17, 0), (0, 0x12, 0)])
    backend = NvmlBackend()
    assert watts(backend) == [107.0, 102.0]
    assert "PCI bus order" not in backend.status().detail


def test_nvml_first_n_gpus_through_the_sampler(nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    sampler = TelemetrySampler(gpus=2)
    try:
        sample = sampler.sample_now()
    finally:
        sampler.stop()
    assert [g.power_w for g in sample.gpus] == [104.0, 105.0]


# --- amdsmi -------------------------------------------------------------------------------------


def test_amd_unset_reads_all_eight_in_hip_order(smi):
    assert watts(AmdSmiBackend()) == [100.0 + i for i in range(NODE)]


@pytest.mark.parametrize("variable", ["HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"])
@pytest.mark.parametrize("value, expected", [("0,1", [100, 101]), ("5,2", [105, 102])])
def test_amd_visible_indices_in_that_order(smi, monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    backend = AmdSmiBackend()
    assert watts(backend) == expected
    assert sum(g.power_w for g in backend.read()) == sum(expected)


def test_amd_rocr_first_then_hip_indexes_into_it(smi, monkeypatch):
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "7,6,5,4")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # HIP_VISIBLE_DEVICES takes precedence
    assert watts(AmdSmiBackend()) == [105.0, 107.0]


def test_amd_uuid_bad_index_and_first_n(smi, monkeypatch, caplog):
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "GPU-66,8,GPU-33c0ffee,2")
    with caplog.at_level(logging.WARNING):
        backend = AmdSmiBackend(gpus=2)
    assert watts(backend) == [106.0, 103.0]
    assert "ROCR_VISIBLE_DEVICES" in caplog.text and "index 8 is out of range" in caplog.text


def test_amd_bdf_order_without_enumeration_info(smi, monkeypatch):
    del smi.amdsmi_get_gpu_enumeration_info  # ROCm before 6.4
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "5,2")
    backend = AmdSmiBackend()
    assert watts(backend) == [105.0, 102.0]
    assert "enumeration" not in backend.status().detail


def test_amd_torch_bus_ids(smi, monkeypatch):
    monkeypatch.setattr(visible, "engine_pci_bus_ids", lambda: [(0, 0x14, 0), (0, 0x11, 0)])
    assert watts(AmdSmiBackend()) == [104.0, 101.0]


def test_engine_pci_bus_ids_does_not_initialise_torch(monkeypatch):
    class Cuda:
        initialised = False

        def is_initialized(self):
            return self.initialised

        def device_count(self):
            raise AssertionError("must not touch the runtime before it is initialised")

    class Torch:
        cuda = Cuda()

    monkeypatch.undo()  # the real engine_pci_bus_ids
    monkeypatch.setitem(sys.modules, "torch", Torch)
    assert visible.engine_pci_bus_ids() is None
