"""Hardware history for the graphs: per-GPU power, utilisation and memory, and the node total
power (GPUs + CPU package where measured), over the last minutes.

Every ring is a ``deque`` with a ``maxlen`` and is also pruned by age, so a day-long session (or
a sampler run far faster than 1 Hz) holds at most ``max_points`` entries per GPU: memory stays
flat however many samples arrive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

HISTORY_S = 300.0  # "the last minutes" the graphs cover
MAX_POINTS = 600  # per ring: two points a second over the window at most


@dataclass
class GpuTrace:
    """One GPU's recent readings: (t, power W, utilisation %, memory used %), None = not read."""

    index: int
    name: str
    points: deque = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    power_cap_w: float | None = None


def node_power(sample) -> tuple[float | None, float | None, float | None]:
    """(total, GPUs, CPU package) watts of one sample; a part nobody measured is None and left out
    of the total (never a made-up number)."""
    gpu_w = [g.power_w for g in sample.gpus if g.power_w is not None]
    gpus = sum(gpu_w) if gpu_w else None
    cpu = sample.cpu_power_w
    parts = [p for p in (gpus, cpu) if p is not None]
    return (sum(parts) if parts else None), gpus, cpu


class HardwareHistory:
    def __init__(self, window_s: float = HISTORY_S, max_points: int = MAX_POINTS) -> None:
        self.window_s = window_s
        self.max_points = max_points
        self.gpus: dict[int, GpuTrace] = {}
        self.node: deque = deque(maxlen=max_points)  # (t, total W)
        self.last_t: float | None = None

    def add(self, sample) -> None:
        t = sample.t
        if self.last_t is not None and t <= self.last_t:
            return  # the same sample offered twice (latest() at mount, then the subscription)
        self.last_t = t
        for g in sample.gpus:
            trace = self.gpus.get(g.index)
            if trace is None:
                trace = self.gpus[g.index] = GpuTrace(g.index, g.name, deque(maxlen=self.max_points))
            mem = (
                100.0 * g.mem_used_bytes / g.mem_total_bytes
                if g.mem_used_bytes is not None and g.mem_total_bytes
                else None
            )
            trace.points.append((t, g.power_w, g.util_pct, mem))
            if g.power_cap_w:
                trace.power_cap_w = g.power_cap_w
        self.node.append((t, node_power(sample)[0]))
        for ring in [self.node, *(tr.points for tr in self.gpus.values())]:
            while ring and ring[0][0] < t - self.window_s:
                ring.popleft()

    def series(self, which: int, now: float) -> list[tuple[int, str, list[float], list[float | None]]]:
        """Per GPU: (index, name, seconds before ``now``, values) of power (1), utilisation (2) or
        memory % (3)."""
        out = []
        for trace in self.gpus.values():
            xs = [p[0] - now for p in trace.points]
            out.append((trace.index, trace.name, xs, [p[which] for p in trace.points]))
        return out

    def node_series(self, now: float) -> tuple[list[float], list[float | None]]:
        return [t - now for t, _ in self.node], [w for _, w in self.node]

    def power_caps(self) -> list[float]:
        return sorted({tr.power_cap_w for tr in self.gpus.values() if tr.power_cap_w})

    def average_node_power(self) -> float | None:
        values = [w for _, w in self.node if w is not None]
        return sum(values) / len(values) if values else None

    def __len__(self) -> int:
        return len(self.node) + sum(len(tr.points) for tr in self.gpus.values())
