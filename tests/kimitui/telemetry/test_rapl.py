"""RaplBackend on a fake powercap sysfs tree: ΔE/Δt, wraparound, permissions, absence."""

from __future__ import annotations

import os
import pathlib

import pytest

from kimitui.telemetry import AmdEnergyBackend, CpuPower, RaplBackend


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def zone(root: pathlib.Path, name: str, label: str, energy_uj: int, max_uj: int | None = 10**9):
    path = root / name
    path.mkdir(parents=True)
    (path / "name").write_text(label + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    if max_uj is not None:
        (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


def set_energy(path: pathlib.Path, uj: int) -> None:
    (path / "energy_uj").write_text(f"{uj}\n")


@pytest.fixture
def tree(tmp_path):
    pkg0 = zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    zone(tmp_path, "intel-rapl:0:0", "core", 500_000)  # subzone: inside the package figure
    pkg1 = zone(tmp_path, "intel-rapl:1", "package-1", 2_000_000)
    zone(tmp_path, "intel-rapl:1:0", "dram", 7)
    (tmp_path / "intel-rapl").mkdir()  # the control-type directory, not a zone
    return tmp_path, pkg0, pkg1


def test_power_is_package_energy_delta_over_time(tree):
    root, pkg0, pkg1 = tree
    clock = Clock()
    backend = RaplBackend(root, clock=clock)
    assert backend.available and backend.status().detail == "package-0, package-1"
    clock.t += 2.0
    set_energy(pkg0, 1_000_000 + 150_000_000)  # 150 J
    set_energy(pkg1, 2_000_000 + 250_000_000)  # 250 J
    assert backend.read() == CpuPower(power_w=pytest.approx(200.0), energy_j=pytest.approx(400.0))
    clock.t += 1.0
    set_energy(pkg0, 1_000_000 + 250_000_000)
    set_energy(pkg1, 2_000_000 + 250_000_000)
    assert backend.read() == CpuPower(power_w=pytest.approx(100.0), energy_j=pytest.approx(500.0))


def test_wraparound_uses_max_energy_range(tmp_path):
    pkg = zone(tmp_path, "intel-rapl:0", "package-0", 900_000_000, max_uj=1_000_000_000)
    clock = Clock()
    backend = RaplBackend(tmp_path, clock=clock)
    clock.t += 1.0
    set_energy(pkg, 50_000_000)  # wrapped: 100 J to the top, then 50 J
    reading = backend.read()
    assert reading.power_w == pytest.approx(150.0)
    assert reading.energy_j == pytest.approx(150.0)


def test_backwards_counter_without_range_is_unknown_not_guessed(tmp_path):
    pkg = zone(tmp_path, "intel-rapl:0", "package-0", 900_000_000, max_uj=None)
    clock = Clock()
    backend = RaplBackend(tmp_path, clock=clock)
    clock.t += 1.0
    set_energy(pkg, 50_000_000)
    assert backend.read() == CpuPower(power_w=None, energy_j=None)
    clock.t += 1.0
    set_energy(pkg, 80_000_000)  # counting resumes from the new base
    assert backend.read() == CpuPower(power_w=pytest.approx(30.0), energy_j=pytest.approx(30.0))


def test_permission_denied_is_unavailable_with_hint(tree, monkeypatch):
    root, _, _ = tree
    real_read_text = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    backend = RaplBackend(root)
    assert not backend.available
    assert "permission denied" in backend.error and "energy_uj" in backend.error
    assert "CVE-2020-8694" in backend.error


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied_by_file_mode(tree):
    root, pkg0, _ = tree
    (pkg0 / "energy_uj").chmod(0o200)
    backend = RaplBackend(root)
    assert not backend.available and "permission denied" in backend.error


def test_absent_tree_is_unavailable(tmp_path):
    backend = RaplBackend(tmp_path / "nope")
    assert not backend.available and "no RAPL package domain" in backend.error
    zone(tmp_path, "intel-rapl:0:0", "core", 1)
    assert not RaplBackend(tmp_path).available


def test_counter_vanishing_at_run_time_raises_for_the_sampler(tree):
    root, pkg0, _ = tree
    backend = RaplBackend(root, clock=Clock())
    (pkg0 / "energy_uj").unlink()
    with pytest.raises(OSError):
        backend.read()


def hwmon(root: pathlib.Path, name: str, driver: str, counters: dict[str, int]) -> pathlib.Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "name").write_text(driver + "\n")
    for i, (label, uj) in enumerate(counters.items(), start=1):
        (path / f"energy{i}_label").write_text(label + "\n")
        (path / f"energy{i}_input").write_text(f"{uj}\n")
    return path


def test_amd_energy_hwmon_sums_socket_counters(tmp_path):
    hwmon(tmp_path, "hwmon0", "k10temp", {"Esocket0": 1})  # another driver: ignored
    dev = hwmon(tmp_path, "hwmon3", "amd_energy", {"Ecore000": 5, "Esocket0": 1_000_000, "Esocket1": 0})
    clock = Clock()
    backend = AmdEnergyBackend(tmp_path, clock=clock)
    assert backend.available and backend.status().detail == "Esocket0, Esocket1"
    clock.t += 0.5
    (dev / "energy1_input").write_text("999999999\n")  # a core counter: not summed
    (dev / "energy2_input").write_text(f"{1_000_000 + 60_000_000}\n")
    (dev / "energy3_input").write_text(f"{40_000_000}\n")
    assert backend.read() == CpuPower(power_w=pytest.approx(200.0), energy_j=pytest.approx(100.0))
    assert "amd_energy" in AmdEnergyBackend(tmp_path / "none").error
