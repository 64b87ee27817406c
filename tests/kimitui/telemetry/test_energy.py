"""window_energy / energy_per_token against hand-computed values."""

from __future__ import annotations

import pytest

from kimitui.telemetry import GpuSample, Sample, energy_per_token, window_energy


def gpu(index=0, power=None, energy=None, vendor="amd") -> GpuSample:
    return GpuSample(index=index, name="g", vendor=vendor, power_w=power, energy_j=energy)


def sample(t, gpus=(), cpu_power=None, cpu_energy=None) -> Sample:
    return Sample(t=t, wall=1e9 + t, gpus=tuple(gpus), cpu_power_w=cpu_power, cpu_energy_j=cpu_energy)


def test_counters_are_differenced_and_interpolated_at_the_edges():
    # Power readings deliberately disagree with the counters: the counters must win.
    samples = [
        sample(t, [gpu(power=999.0, energy=e)]) for t, e in [(0.0, 100.0), (1.0, 150.0), (2.0, 250.0), (3.0, 300.0)]
    ]
    w = window_energy(samples, 0.5, 2.5)
    # e(0.5) = 125, e(2.5) = 275
    assert w.gpu_energy_j == pytest.approx(150.0)
    assert w.avg_gpu_power_w == pytest.approx(75.0)
    assert w.per_gpu_avg_power_w == (pytest.approx(75.0),)
    assert w.duration_s == 2.0 and w.num_gpus == 1


def test_trapezoids_when_counters_are_missing():
    samples = [sample(t, [gpu(power=p)]) for t, p in [(0.0, 100.0), (1.0, 200.0), (2.0, 200.0), (3.0, 100.0)]]
    w = window_energy(list(reversed(samples)), 0.5, 2.5)  # order of the input does not matter
    # p(0.5)=150: 0.5*(150+200)/2 = 87.5; [1,2]: 200; p(2.5)=150: 87.5  -> 375 J
    assert w.gpu_energy_j == pytest.approx(375.0)
    assert w.avg_gpu_power_w == pytest.approx(187.5)


def test_window_on_sample_boundaries():
    samples = [sample(t, [gpu(power=p)]) for t, p in [(0.0, 100.0), (1.0, 300.0), (2.0, 300.0)]]
    assert window_energy(samples, 0.0, 2.0).gpu_energy_j == pytest.approx(200.0 + 300.0)
    assert window_energy(samples, 1.0, 2.0).gpu_energy_j == pytest.approx(300.0)


def test_one_sample_missing_the_counter_falls_back_to_power():
    samples = [
        sample(0.0, [gpu(power=100.0, energy=0.0)]),
        sample(1.0, [gpu(power=100.0, energy=None)]),
        sample(2.0, [gpu(power=100.0, energy=5000.0)]),
    ]
    assert window_energy(samples, 0.0, 2.0).gpu_energy_j == pytest.approx(200.0)


def test_counter_reset_falls_back_to_power():
    samples = [sample(0.0, [gpu(power=10.0, energy=1e6)]), sample(1.0, [gpu(power=10.0, energy=3.0)])]
    assert window_energy(samples, 0.0, 1.0).gpu_energy_j == pytest.approx(10.0)


def test_power_gaps_are_skipped_but_edges_must_be_covered():
    samples = [sample(0.0, [gpu(power=100.0)]), sample(1.0, [gpu(power=None)]), sample(2.0, [gpu(power=100.0)])]
    assert window_energy(samples, 0.0, 2.0).gpu_energy_j == pytest.approx(200.0)
    # The window reaches past the last power reading: not measured, not extrapolated.
    assert window_energy(samples, 0.0, 2.5).gpu_energy_j is None
    assert window_energy(samples, -0.5, 2.0).gpu_energy_j is None
    # Fewer than two samples with power.
    one = [sample(0.0, [gpu(power=100.0)]), sample(1.0, [gpu()]), sample(2.0, [gpu()])]
    assert window_energy(one, 0.0, 2.0).gpu_energy_j is None


def test_two_gpus_sum_and_a_missing_gpu_makes_the_total_none():
    samples = [sample(t, [gpu(0, power=100.0), gpu(1, power=300.0)]) for t in (0.0, 1.0, 2.0)]
    w = window_energy(samples, 0.0, 2.0)
    assert w.num_gpus == 2
    assert w.gpu_energy_j == pytest.approx(800.0)
    assert w.avg_gpu_power_w == pytest.approx(400.0)
    assert w.per_gpu_avg_power_w == (pytest.approx(100.0), pytest.approx(300.0))

    samples = [sample(t, [gpu(0, power=100.0), gpu(1)]) for t in (0.0, 1.0, 2.0)]
    w = window_energy(samples, 0.0, 2.0)
    assert w.gpu_energy_j is None and w.avg_gpu_power_w is None
    assert w.per_gpu_avg_power_w == (pytest.approx(100.0), None)


def test_same_index_different_vendor_are_different_gpus():
    samples = [sample(t, [gpu(0, power=100.0), gpu(0, power=50.0, vendor="nvidia")]) for t in (0.0, 1.0)]
    assert window_energy(samples, 0.0, 1.0).gpu_energy_j == pytest.approx(150.0)


def test_cpu_from_counter_and_from_power():
    by_counter = [sample(0.0, cpu_power=1.0, cpu_energy=0.0), sample(2.0, cpu_power=1.0, cpu_energy=300.0)]
    w = window_energy(by_counter, 0.0, 2.0)
    assert w.cpu_energy_j == pytest.approx(300.0) and w.avg_cpu_power_w == pytest.approx(150.0)
    assert w.num_gpus == 0 and w.gpu_energy_j is None and w.per_gpu_avg_power_w == ()

    by_power = [sample(0.0, cpu_power=100.0), sample(2.0, cpu_power=200.0)]
    assert window_energy(by_power, 0.0, 2.0).cpu_energy_j == pytest.approx(300.0)
    assert window_energy([sample(0.0), sample(2.0)], 0.0, 2.0).cpu_energy_j is None


def test_no_samples_and_bad_window():
    w = window_energy([], 0.0, 1.0)
    assert w.gpu_energy_j is None and w.cpu_energy_j is None and w.num_gpus == 0
    with pytest.raises(ValueError, match="t1 > t0"):
        window_energy([], 1.0, 1.0)


def test_energy_per_token():
    both = [sample(t, [gpu(power=300.0)], cpu_power=100.0, cpu_energy=100.0 * t) for t in (0.0, 1.0, 2.0)]
    assert energy_per_token(both, 0.0, 2.0, tokens=400) == pytest.approx((600.0 + 200.0) / 400)
    assert energy_per_token(both, 0.0, 2.0, tokens=400, include_cpu=False) == pytest.approx(1.5)
    assert energy_per_token(both, 0.0, 2.0, tokens=0) is None

    # No RAPL on this machine: GPU energy only.
    gpu_only = [sample(t, [gpu(power=300.0)]) for t in (0.0, 1.0, 2.0)]
    assert energy_per_token(gpu_only, 0.0, 2.0, tokens=600) == pytest.approx(1.0)

    # CPU reported but not integrable over the window: None, not the GPU part alone.
    cpu_gap = [
        sample(0.0, [gpu(power=300.0)], cpu_power=100.0),
        sample(1.0, [gpu(power=300.0)]),
        sample(2.0, [gpu(power=300.0)]),
    ]
    assert energy_per_token(cpu_gap, 0.0, 2.0, tokens=600) is None

    assert energy_per_token([sample(0.0), sample(2.0)], 0.0, 2.0, tokens=10) is None
