"""The one telemetry thread: reads every backend each interval into a ring buffer."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from kimitui.telemetry.backend import Backend
from kimitui.telemetry.detect import detect_backends
from kimitui.telemetry.sample import BackendStatus, CpuPower, GpuSample, HostStats, Sample

log = logging.getLogger(__name__)

Callback = Callable[[Sample], None]


def _blank(reading: Any) -> Any:
    """The same shape as ``reading`` with every value unknown (keeps failed GPUs listed as n/a)."""
    if isinstance(reading, list):  # a backend that reads several kinds at once (remote nodes)
        return [_blank(r) for r in reading]
    if isinstance(reading, tuple):
        return tuple(GpuSample(g.index, g.name, g.vendor) for g in reading)
    if isinstance(reading, CpuPower):
        return CpuPower()
    if isinstance(reading, HostStats):
        return HostStats()
    return None


def _compose(t: float, wall: float, readings: Sequence[Any]) -> Sample:
    gpus: list[GpuSample] = []
    cpu = CpuPower()
    host = HostStats()
    flat: list[Any] = []
    for reading in readings:
        flat.extend(reading if isinstance(reading, list) else [reading])
    for reading in flat:
        if isinstance(reading, tuple):
            gpus.extend(reading)
        elif isinstance(reading, CpuPower):
            if cpu.power_w is None and cpu.energy_j is None:
                cpu = reading
        elif isinstance(reading, HostStats):
            host = reading
    return Sample(
        t=t,
        wall=wall,
        gpus=tuple(gpus),
        cpu_power_w=cpu.power_w,
        cpu_energy_j=cpu.energy_j,
        cpu_util_pct=host.cpu_util_pct,
        per_cpu_util_pct=host.per_cpu_util_pct,
        ram_used_bytes=host.ram_used_bytes,
        ram_total_bytes=host.ram_total_bytes,
        process_rss_bytes=host.process_rss_bytes,
    )


class TelemetrySampler:
    """Reads every available backend every ``interval_s`` on one daemon thread.

    ``backends=None`` auto-detects amdsmi, NVML, RAPL and psutil; ``gpus`` then limits the GPU
    backends to the first N GPUs the engine sees (``--gpus N``; all visible ones when None).
    Samples older than ``history_s`` (relative to the newest) are dropped. Use as a context manager, or call
    ``start()`` and ``stop()``; a stopped sampler has closed its backends and cannot restart.
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        backends: Sequence[Backend] | None = None,
        history_s: float = 600.0,
        gpus: int | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"telemetry interval_s must be > 0 seconds, got {interval_s!r}")
        if not history_s >= 0:
            raise ValueError(f"telemetry history_s must be >= 0 seconds, got {history_s!r}")
        self._interval_s = float(interval_s)
        self._history_s = float(history_s)
        self._backends: tuple[Backend, ...] = tuple(detect_backends(gpus=gpus) if backends is None else backends)
        # Time-based pruning keeps history_s; the cap only bounds memory if sample_now() is spammed.
        self._history: deque[Sample] = deque(maxlen=4 * math.ceil(history_s / interval_s) + 16)
        self._lock = threading.Lock()  # history and subscribers
        self._read_lock = threading.Lock()  # backend reads: the thread vs sample_now()
        self._subscribers: list[Callback] = []
        self._bad_callbacks: set[int] = set()
        self._errors: dict[int, str] = {}  # backend position -> current run-time failure
        self._reported: set[int] = set()  # backend positions already warned about
        self._last_ok: dict[int, Any] = {}
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def interval_s(self) -> float:
        return self._interval_s

    @property
    def backends(self) -> tuple[Backend, ...]:
        return self._backends

    def start(self) -> "TelemetrySampler":
        """Start the sampler thread (no-op if running)."""
        if self._closed:
            raise RuntimeError("TelemetrySampler was stopped and its backends closed; make a new one")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kimitui-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, wait for it, and close every backend. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, 5 * self._interval_s))
        # A backend stuck inside a driver call must not be shut down under its feet.
        if not self._read_lock.acquire(timeout=5.0):
            log.warning("telemetry thread did not finish; leaving backends open")
            return
        try:
            for backend in self._backends:
                try:
                    backend.close()
                except Exception as exc:
                    log.debug("closing telemetry backend %s failed: %r", backend.name, exc)
        finally:
            self._read_lock.release()

    def __enter__(self) -> "TelemetrySampler":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def latest(self) -> Sample | None:
        """The newest sample, or None before the first tick."""
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self, since_t: float | None = None) -> list[Sample]:
        """Samples in time order, those with ``t >= since_t`` if given.

        For ``window_energy(…, t0, t1)`` ask from a little before t0 (e.g. ``t0 - 2 *
        interval_s``): the sample just before t0 is needed to interpolate at t0.
        """
        with self._lock:
            samples = list(self._history)
        if since_t is None:
            return samples
        return [s for s in samples if s.t >= since_t]

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        """Call ``callback(sample)`` on the sampler thread after each tick; returns an unsubscribe.

        Exceptions from the callback are logged (the first time, with traceback) and swallowed.
        """
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def sample_now(self) -> Sample:
        """Read every backend in the caller's thread and record the sample in the history.

        Benchmarks bracket a run with this so the energy window has samples at both ends.
        Subscribers are not called: they only ever run on the sampler thread.
        """
        if self._closed:
            raise RuntimeError("TelemetrySampler was stopped and its backends closed")
        return self._tick()

    def _tick(self) -> Sample:
        with self._read_lock:
            start, wall = time.monotonic(), time.time()
            readings = [self._read(i, b) for i, b in enumerate(self._backends) if b.available]
            # Backends are read one after another; the midpoint is the fairest single timestamp.
            sample = _compose((start + time.monotonic()) / 2, wall, readings)
            with self._lock:
                self._history.append(sample)
                while self._history and self._history[0].t < sample.t - self._history_s:
                    self._history.popleft()
        return sample

    def backend_status(self) -> list[BackendStatus]:
        """Per backend: available, and a detail line or the reason it is (now) unavailable."""
        statuses = []
        for i, backend in enumerate(self._backends):
            error = self._errors.get(i)
            if error is not None:
                statuses.append(BackendStatus(backend.name, False, error))
            else:
                statuses.append(backend.status())
        return statuses

    def _read(self, position: int, backend: Backend) -> Any:
        try:
            reading = backend.read()
        except Exception as exc:
            self._errors[position] = f"read failed: {exc!r}"
            if position not in self._reported:
                self._reported.add(position)
                log.warning("telemetry backend %s failed, showing n/a: %r", backend.name, exc)
            return _blank(self._last_ok.get(position))
        if self._errors.pop(position, None) is not None:
            log.debug("telemetry backend %s recovered", backend.name)
        self._last_ok[position] = reading
        return reading

    def _notify(self, sample: Sample) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(sample)
            except Exception:
                if id(callback) in self._bad_callbacks:
                    log.debug("telemetry subscriber %r raised again", callback, exc_info=True)
                else:
                    self._bad_callbacks.add(id(callback))
                    log.exception("telemetry subscriber %r raised; continuing", callback)

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop_event.is_set():
            try:
                self._notify(self._tick())
            except Exception:  # a bug here must not end telemetry for the whole session
                log.exception("telemetry tick failed")
            next_t += self._interval_s
            delay = next_t - time.monotonic()
            if delay < 0:
                # Fell behind (slow driver call): skip the missed ticks rather than burst.
                next_t, delay = time.monotonic(), 0.0
            self._stop_event.wait(delay)
