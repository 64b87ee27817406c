"""Energy and average power over a time window, from energy counters or integrated power."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from kimitui.telemetry.sample import Sample

T = TypeVar("T")
Point = tuple[float, float]  # (monotonic t, value)
Reader = Callable[[Sample], float | None]


@dataclass(frozen=True)
class EnergyWindow:
    """Energy over ``[t0, t1]``. A None means "not measured", never a guess.

    ``avg_gpu_power_w`` is the sum over GPUs, averaged over the window; the per-GPU tuple
    follows the order GPUs appear in the samples.
    """

    duration_s: float
    num_gpus: int
    gpu_energy_j: float | None
    cpu_energy_j: float | None
    avg_gpu_power_w: float | None
    avg_cpu_power_w: float | None
    per_gpu_avg_power_w: tuple[float | None, ...]


def _bracket(points: Sequence[tuple[float, T]], t0: float, t1: float) -> list[tuple[float, T]] | None:
    """Points from the last one at or before t0 to the first at or after t1; None if uncovered."""
    lo = hi = None
    for i, (t, _) in enumerate(points):
        if t <= t0:
            lo = i
        if t >= t1:
            hi = i
            break
    if lo is None or hi is None:
        return None
    return list(points[lo : hi + 1])


def _interp(a: Point, b: Point, t: float) -> float:
    (ta, va), (tb, vb) = a, b
    return va if tb == ta else va + (vb - va) * (t - ta) / (tb - ta)


def _from_counter(samples: Sequence[Sample], t0: float, t1: float, counter: Reader) -> float | None:
    span = _bracket([(s.t, counter(s)) for s in samples], t0, t1)
    if span is None or any(v is None for _, v in span):
        return None
    # A counter that goes down was reset (driver reload); its difference would be garbage.
    if any(b[1] < a[1] for a, b in zip(span, span[1:])):
        return None
    # span[0].t <= t0 < span[1].t and span[-2].t < t1 <= span[-1].t, since t0 < t1.
    return _interp(span[-2], span[-1], t1) - _interp(span[0], span[1], t0)


def _from_power(samples: Sequence[Sample], t0: float, t1: float, power: Reader) -> float | None:
    points = [(s.t, p) for s in samples if (p := power(s)) is not None]
    span = _bracket(points, t0, t1)
    if span is None:
        return None
    total = 0.0
    for a, b in zip(span, span[1:]):
        lo, hi = max(a[0], t0), min(b[0], t1)
        if hi > lo:
            total += (_interp(a, b, lo) + _interp(a, b, hi)) / 2 * (hi - lo)
    return total


def _energy(samples: Sequence[Sample], t0: float, t1: float, counter: Reader, power: Reader) -> float | None:
    energy = _from_counter(samples, t0, t1, counter)
    return energy if energy is not None else _from_power(samples, t0, t1, power)


def _gpu_reader(key: tuple[str, int], field: str) -> Reader:
    def read(sample: Sample) -> float | None:
        for gpu in sample.gpus:
            if (gpu.vendor, gpu.index) == key:
                return getattr(gpu, field)
        return None

    return read


def _relevant(samples: Sequence[Sample], t0: float, t1: float) -> list[Sample]:
    """The samples that bear on the window: the bracket if covered, else those inside it."""
    span = _bracket([(s.t, s) for s in samples], t0, t1)
    if span is not None:
        return [s for _, s in span]
    return [s for s in samples if t0 <= s.t <= t1]


def _gpu_keys(samples: Sequence[Sample]) -> list[tuple[str, int]]:
    keys: dict[tuple[str, int], None] = {}
    for sample in samples:
        for gpu in sample.gpus:
            keys.setdefault((gpu.vendor, gpu.index), None)
    return list(keys)


def _check_window(t0: float, t1: float) -> None:
    if not t1 > t0:
        raise ValueError(f"energy window needs t1 > t0, got t0={t0!r}, t1={t1!r}")


def window_energy(samples: Sequence[Sample], t0: float, t1: float) -> EnergyWindow:
    """GPU and CPU energy over ``[t0, t1]`` (``time.monotonic()`` values, like ``Sample.t``).

    Uses hardware energy counters when every sample from the one at/before t0 to the one
    at/after t1 has them (interpolated at t0 and t1), else the trapezoidal integral of power
    over the sample timestamps clipped to the window. Needs samples on both sides of the
    window; otherwise, or when a GPU has neither, the energy is None. Total GPU energy is None
    if any GPU's is.
    """
    _check_window(t0, t1)
    ordered = sorted(samples, key=lambda s: s.t)
    duration = t1 - t0
    keys = _gpu_keys(_relevant(ordered, t0, t1))
    per_gpu = [_energy(ordered, t0, t1, _gpu_reader(key, "energy_j"), _gpu_reader(key, "power_w")) for key in keys]
    gpu_energy = sum(per_gpu) if keys and all(e is not None for e in per_gpu) else None
    cpu_energy = _energy(ordered, t0, t1, lambda s: s.cpu_energy_j, lambda s: s.cpu_power_w)
    return EnergyWindow(
        duration_s=duration,
        num_gpus=len(keys),
        gpu_energy_j=gpu_energy,
        cpu_energy_j=cpu_energy,
        avg_gpu_power_w=None if gpu_energy is None else gpu_energy / duration,
        avg_cpu_power_w=None if cpu_energy is None else cpu_energy / duration,
        per_gpu_avg_power_w=tuple(None if e is None else e / duration for e in per_gpu),
    )


def energy_per_token(
    samples: Sequence[Sample], t0: float, t1: float, tokens: int, include_cpu: bool = True
) -> float | None:
    """Joules per token over ``[t0, t1]``: GPU energy, plus CPU package energy when measured.

    The CPU counts only where the machine reports it at all (RAPL readable); if it is reported
    but cannot be integrated over this window, or the GPUs cannot, the answer is None. None
    too with no energy source or ``tokens <= 0``.
    """
    _check_window(t0, t1)
    if tokens <= 0:
        return None
    window = window_energy(samples, t0, t1)
    relevant = _relevant(sorted(samples, key=lambda s: s.t), t0, t1)
    total = 0.0
    measured = False
    if window.num_gpus:
        if window.gpu_energy_j is None:
            return None
        total, measured = total + window.gpu_energy_j, True
    cpu_reported = any(s.cpu_energy_j is not None or s.cpu_power_w is not None for s in relevant)
    if include_cpu and cpu_reported:
        if window.cpu_energy_j is None:
            return None
        total, measured = total + window.cpu_energy_j, True
    return total / tokens if measured else None
