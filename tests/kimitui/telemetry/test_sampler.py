"""TelemetrySampler: thread life cycle, subscribers, failing backends, history; host backend."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from kimitui.telemetry import (
    AmdEnergyBackend,
    Backend,
    BackendStatus,
    CpuPower,
    GpuSample,
    HostBackend,
    HostStats,
    RaplBackend,
    TelemetrySampler,
    describe_backends,
)

WAIT_S = 10.0  # generous: only reached when something is broken


class FakeGpus(Backend):
    name = "fakegpu"

    def __init__(self, fail_on: set[int] = frozenset(), available: bool = True) -> None:
        super().__init__()
        self.available = available
        self.error = None if available else "no fake GPUs here"
        self.fail_on = set(fail_on)
        self.reads = 0
        self.closed = 0

    def read(self) -> tuple[GpuSample, ...]:
        self.reads += 1
        if self.reads in self.fail_on:
            raise RuntimeError(f"driver hiccup on read {self.reads}")
        energy = 100.0 * self.reads
        return (
            GpuSample(0, "Fake MI355X", "amd", power_w=500.0, energy_j=energy),
            GpuSample(1, "Fake MI355X", "amd", power_w=510.0, energy_j=energy),
        )

    def close(self) -> None:
        self.closed += 1

    @property
    def detail(self) -> str:
        return "2 GPU(s): Fake MI355X"


class FakeCpu(Backend):
    name = "fakecpu"

    def __init__(self) -> None:
        super().__init__()
        self.available = True

    def read(self) -> CpuPower:
        return CpuPower(power_w=150.0, energy_j=42.0)


class AlwaysFails(Backend):
    name = "broken"

    def __init__(self) -> None:
        super().__init__()
        self.available = True
        self.reads = 0

    def read(self) -> HostStats:
        self.reads += 1
        raise OSError("sensor gone")


def test_sample_now_composes_every_backend():
    unavailable = FakeGpus(available=False)
    sampler = TelemetrySampler(interval_s=0.01, backends=[FakeGpus(), FakeCpu(), unavailable])
    s = sampler.sample_now()
    assert [g.power_w for g in s.gpus] == [500.0, 510.0]
    assert (s.cpu_power_w, s.cpu_energy_j) == (150.0, 42.0)
    assert s.cpu_util_pct is None and s.per_cpu_util_pct == () and s.process_rss_bytes is None
    assert unavailable.reads == 0  # unavailable backends are never read
    assert sampler.latest() is s
    assert sampler.backend_status() == [
        BackendStatus("fakegpu", True, "2 GPU(s): Fake MI355X"),
        BackendStatus("fakecpu", True, ""),
        BackendStatus("fakegpu", False, "no fake GPUs here"),
    ]
    assert describe_backends(sampler.backends)[2].split() == ["fakegpu", "n/a", "no", "fake", "GPUs", "here"]
    sampler.stop()


def test_failing_read_gives_none_values_and_one_warning(caplog):
    gpus = FakeGpus(fail_on={2, 3})
    sampler = TelemetrySampler(interval_s=0.01, backends=[gpus, FakeCpu()])
    with caplog.at_level(logging.WARNING, logger="kimitui.telemetry"):
        first, second, third, fourth = (sampler.sample_now() for _ in range(4))
        status_after_fourth = sampler.backend_status()[0]
        gpus.fail_on = {5}
        sampler.sample_now()
    assert first.gpus[0].power_w == 500.0
    # During the failure the GPUs stay listed, with every reading unknown.
    assert second.gpus == (GpuSample(0, "Fake MI355X", "amd"), GpuSample(1, "Fake MI355X", "amd"))
    assert third.gpus == second.gpus
    assert second.cpu_power_w == 150.0  # other backends unaffected
    assert fourth.gpus[0].energy_j == 400.0
    assert status_after_fourth.available  # recovered
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fakegpu" in warnings[0].getMessage()


def test_backend_failing_from_the_start_reads_as_none():
    sampler = TelemetrySampler(interval_s=0.01, backends=[AlwaysFails()])
    s = sampler.sample_now()
    assert s.cpu_util_pct is None and s.ram_used_bytes is None
    status = sampler.backend_status()[0]
    assert not status.available and "sensor gone" in status.detail


def test_thread_runs_subscribers_and_stops_cleanly(caplog):
    gpus = FakeGpus()
    broken = AlwaysFails()
    got: list = []
    enough = threading.Event()

    def good(sample):
        got.append(sample)
        if len(got) >= 5:
            enough.set()

    def bad(sample):
        raise ValueError("subscriber bug")

    sampler = TelemetrySampler(interval_s=0.005, backends=[gpus, broken])
    sampler.subscribe(bad)
    sampler.subscribe(good)
    unsubscribe = sampler.subscribe(lambda s: got.append("late"))
    unsubscribe()
    with caplog.at_level(logging.WARNING, logger="kimitui.telemetry"):
        with sampler:
            assert sampler.start() is sampler  # second start is a no-op
            assert enough.wait(WAIT_S), "sampler thread produced too few samples"
    assert not any(t.name == "kimitui-telemetry" for t in threading.enumerate())
    assert gpus.closed == 1
    sampler.stop()  # idempotent
    assert gpus.closed == 1
    assert "late" not in got
    assert all(a.t < b.t for a, b in zip(got, got[1:]))
    assert len(sampler.history()) >= 5
    assert sampler.history(since_t=got[2].t)[0] is got[2]
    assert broken.reads >= 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(warnings) == 1 and "broken" in warnings[0].getMessage()
    assert len(errors) == 1 and "subscriber" in errors[0].getMessage()
    with pytest.raises(RuntimeError, match="make a new one"):
        sampler.start()
    with pytest.raises(RuntimeError, match="stopped"):
        sampler.sample_now()


def test_history_is_pruned_by_age():
    sampler = TelemetrySampler(interval_s=1.0, backends=[FakeCpu()], history_s=0.0)
    for _ in range(3):
        last = sampler.sample_now()
    assert sampler.history() == [last]


def test_invalid_configuration_is_explained():
    with pytest.raises(ValueError, match="interval_s"):
        TelemetrySampler(interval_s=0, backends=[])
    with pytest.raises(ValueError, match="history_s"):
        TelemetrySampler(history_s=-1, backends=[])


def test_host_backend_reads_psutil():
    host = HostBackend()
    assert host.available
    stats = host.read()
    assert stats.ram_total_bytes > stats.ram_used_bytes > 0
    assert stats.process_rss_bytes > 0
    assert len(stats.per_cpu_util_pct) >= 1 and 0.0 <= stats.cpu_util_pct <= 100.0
    assert "CPUs" in host.status().detail


def test_describe_backends_detects_and_reports_reasons(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(RaplBackend, "default_root", str(tmp_path / "powercap"))
    monkeypatch.setattr(AmdEnergyBackend, "default_root", str(tmp_path / "hwmon"))
    lines = describe_backends()
    assert [line.split()[0] for line in lines] == ["amdsmi", "nvml", "rapl", "amd_energy", "psutil"]
    assert lines[0].split()[1] == "n/a" and "amdsmi" in lines[0]
    assert "no RAPL package domain" in lines[2]
    assert lines[4].split()[1] == "ok"


def test_telemetry_imports_no_ui_engine_or_sibling_packages():
    code = (
        "import sys, kimitui.telemetry; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('textual', 'engine', 'kernels', 'themes')"
        " or (m.startswith('kimitui.') and not m.startswith('kimitui.telemetry'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
