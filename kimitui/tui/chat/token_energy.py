"""Energy per output token over the last minute: telemetry energy / tokens the engine produced.

Token counts come from EngineStats polls, stamped with the same monotonic clock as telemetry
samples, so both sides of the ratio cover the same window.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque

from kimitui.telemetry import energy_per_token

WINDOW_S = 60.0


class TokenEnergyMeter:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._counts: deque[tuple[float, int]] = deque()  # (t, total_generation_tokens)

    def record(self, t: float, total_generation_tokens: int) -> None:
        if self._counts and t <= self._counts[-1][0]:
            return
        self._counts.append((t, total_generation_tokens))
        while len(self._counts) > 2 and self._counts[1][0] < t - 2 * self.window_s:
            self._counts.popleft()

    def tokens_between(self, t0: float, t1: float) -> int | None:
        """Tokens generated in [t0, t1], from the counts recorded at or before each end."""
        times = [t for t, _ in self._counts]
        i0, i1 = bisect_right(times, t0) - 1, bisect_right(times, t1) - 1
        if i0 < 0 or i1 < 0:
            return None
        return self._counts[i1][1] - self._counts[i0][1]

    def joules_per_token(self, samples, now: float) -> float | None:
        """None when there is no energy source, no tokens in the window, or too little history."""
        if not samples:
            return None
        t0 = max(now - self.window_s, samples[0].t, self._counts[0][0] if self._counts else now)
        if not now > t0:
            return None
        tokens = self.tokens_between(t0, now)
        if not tokens:
            return None
        try:
            return energy_per_token(samples, t0, now, tokens)
        except ValueError:
            return None
