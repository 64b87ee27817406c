"""How much of the host experts' CPU time a layer hides behind its device experts.

Per MoE layer with host experts the forward is: submit the host share to a worker thread, compute the
device's own experts, join. Three clocks tell whether the CPU work is hidden:

* host: the worker's time computing (after its inputs arrived);
* device: the device experts' time (device events on an accelerator; on a CPU the driving thread's
  wall time of that call, which is the computation itself);
* wait: the driving thread's time blocked at the join.

``hidden fraction = 1 - wait / host``: 1 when the join never waits, 0 when the whole host time is
waited for. Off by default (clocks cost a little per layer); ``enable(model)`` or
``KIMITUI_OFFLOAD_TIMING=1`` (read when the model is built) turns it on, ``report(model)`` sums it.
benchmarks/gpu_check.py and cpu_decode_step.py call these two functions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class LayerTiming:
    """Sums over the calls of one layer's host experts (seconds)."""

    calls: int = 0
    host_s: float = 0.0
    input_wait_s: float = 0.0  # worker waiting for the device -> host copy
    device_s: float = 0.0
    wait_s: float = 0.0
    _events: list = field(default_factory=list, repr=False)  # (start, end) device events not yet read
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_host(self, input_wait: float, host: float) -> None:
        with self._lock:  # written by the worker thread, read by the driving one
            self.input_wait_s += input_wait
            self.host_s += host

    def device_span(self, device: torch.device):
        """Context for the device experts' call: device events on an accelerator, wall time on a CPU."""
        return _DeviceSpan(self, device)

    def add_wait(self, wait: float) -> None:
        self.calls += 1
        self.wait_s += wait

    def settle(self) -> None:
        """Read the device events recorded so far (synchronizes on them: call outside the hot path)."""
        for start, end in self._events:
            end.synchronize()
            self.device_s += start.elapsed_time(end) / 1e3
        self._events.clear()


class _DeviceSpan:
    def __init__(self, timing: LayerTiming, device: torch.device):
        self.timing, self.device = timing, device

    def __enter__(self):
        if self.device.type == "cpu":
            self.t0 = time.perf_counter()
        else:
            self.start = torch.Event(self.device.type, enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cpu":
            self.timing.device_s += time.perf_counter() - self.t0
        else:
            end = torch.Event(self.device.type, enable_timing=True)
            end.record()
            self.timing._events.append((self.start, end))
        return False


def _executors(model):
    for name, m in model.named_modules():
        executor = getattr(m, "executor", None)
        if executor is not None and hasattr(executor, "timing"):
            yield name, executor


def enable(model, on: bool = True) -> int:
    """Start (fresh sums) or stop timing every host-expert layer of ``model``; -> layers affected."""
    count = 0
    for _, executor in _executors(model):
        executor.timing = LayerTiming() if on else None
        count += 1
    return count


def report(model) -> dict:
    """Per layer and total sums since ``enable``: {"layers": {name: {...}}, "total": {...}} with
    calls, host_s, input_wait_s, device_s, wait_s and hidden_fraction (None before any call)."""
    layers, total = {}, LayerTiming()
    for name, executor in _executors(model):
        t = executor.timing
        if t is None:
            continue
        t.settle()
        layers[name] = _row(t)
        total.calls += t.calls
        total.add_host(t.input_wait_s, t.host_s)
        total.device_s += t.device_s
        total.wait_s += t.wait_s
    return {"layers": layers, "total": _row(total)}


def _row(t: LayerTiming) -> dict:
    hidden = None if t.host_s <= 0 else max(0.0, 1.0 - t.wait_s / t.host_s)
    return {
        "calls": t.calls,
        "host_s": t.host_s,
        "input_wait_s": t.input_wait_s,
        "device_s": t.device_s,
        "wait_s": t.wait_s,
        "hidden_fraction": hidden,
    }
