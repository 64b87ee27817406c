"""The throughput panel's numbers for a remote server: rates from its counters between scrapes.

``RemoteStats`` has the attribute names of the engine's ``EngineStats`` (what the panel and the
energy meter read), with None where the server does not say, plus server-side TTFT / TPOT over
the last minute and a ``note`` saying what is unavailable. Without ``/metrics`` the token rate
and total are those of this client's own replies, and the note says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kimitui.client.server_metrics import ServerSnapshot

RATE_WINDOW_S = 3.0  # token rates over the last few scrapes: steadier than one 1 s difference
LATENCY_WINDOW_S = 60.0  # TTFT / TPOT percentiles over the last minute
MAX_SNAPSHOTS = 256  # bounds the ring whatever the scrape period


@dataclass(frozen=True)
class RemoteStats:
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None
    prefix_cache_hit_rate: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    num_preemptions: int | None = None
    kv_cache_capacity_tokens: int | None = None
    total_prompt_tokens: int | None = None
    total_generation_tokens: int | None = None
    num_finished: int | None = None
    spec_decode: object | None = None
    # remote only
    flavour: str | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    tpot_p50: float | None = None
    tpot_p90: float | None = None
    latency_window_s: float | None = None
    note: str = ""


def _int(v: float | None) -> int | None:
    return None if v is None else int(round(v))


class ServerStatsTracker:
    """Keeps the recent scrapes (a bounded ring) and turns them into ``RemoteStats``."""

    def __init__(self) -> None:
        self._ring: deque[tuple[float, ServerSnapshot]] = deque(maxlen=MAX_SNAPSHOTS)

    def add(self, t: float, snap: ServerSnapshot) -> RemoteStats:
        last = self._ring[-1][1] if self._ring else None
        if last is not None and _went_back(last, snap):  # the server restarted: start over
            self._ring.clear()
        self._ring.append((t, snap))
        while len(self._ring) > 2 and self._ring[1][0] < t - LATENCY_WINDOW_S:
            self._ring.popleft()
        return self._stats(t, snap)

    def _at_or_before(self, t: float) -> tuple[float, ServerSnapshot] | None:
        best = None
        for entry in self._ring:
            if entry[0] <= t:
                best = entry
            else:
                break
        return best

    def _stats(self, t: float, snap: ServerSnapshot) -> RemoteStats:
        prefill = decode = None
        older = self._at_or_before(t - RATE_WINDOW_S) or (self._ring[0] if len(self._ring) > 1 else None)
        if older is not None and t > older[0]:
            dt = t - older[0]
            if snap.prompt_tokens is not None and older[1].prompt_tokens is not None:
                prefill = max(0.0, snap.prompt_tokens - older[1].prompt_tokens) / dt
            if snap.generation_tokens is not None and older[1].generation_tokens is not None:
                decode = max(0.0, snap.generation_tokens - older[1].generation_tokens) / dt
        first_t, first = self._ring[0]
        window = t - first_t
        ttft = snap.ttft.since(first.ttft if first is not snap else None) if snap.ttft else None
        tpot = snap.tpot.since(first.tpot if first is not snap else None) if snap.tpot else None
        missing = [
            name
            for name, v in (
                ("token counters", snap.generation_tokens),
                ("queue", snap.running),
                ("KV use", snap.kv_usage),
                ("TTFT/TPOT", snap.ttft),
            )
            if v is None
        ]
        note = f"{snap.flavour} /metrics" + (f"; not exposed: {', '.join(missing)}" if missing else "")
        return RemoteStats(
            num_running=_int(snap.running),
            num_waiting=_int(snap.waiting),
            kv_cache_usage=snap.kv_usage,
            prefix_cache_hit_rate=snap.cumulative_prefix_hit_rate,
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=decode,
            kv_cache_capacity_tokens=_int(snap.kv_capacity_tokens),
            total_prompt_tokens=_int(snap.prompt_tokens),
            total_generation_tokens=_int(snap.generation_tokens),
            spec_decode=snap.spec_decode,
            flavour=snap.flavour,
            ttft_p50=ttft.quantile(0.5) if ttft else None,
            ttft_p90=ttft.quantile(0.9) if ttft else None,
            tpot_p50=tpot.quantile(0.5) if tpot else None,
            tpot_p90=tpot.quantile(0.9) if tpot else None,
            latency_window_s=window if first is not snap else None,
            note=note,
        )


def _went_back(before: ServerSnapshot, now: ServerSnapshot) -> bool:
    return any(
        a is not None and b is not None and b < a
        for a, b in ((before.generation_tokens, now.generation_tokens), (before.prompt_tokens, now.prompt_tokens))
    )


class ClientTokenRate:
    """Tokens this client received, for the panel when the server has no ``/metrics``."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.total = 0
        self._events: deque[tuple[float, int]] = deque(maxlen=4096)

    def add(self, t: float, tokens: int) -> None:
        if tokens > 0:
            self.total += tokens
            self._events.append((t, tokens))

    def rate(self, now: float) -> float:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        return sum(n for _, n in self._events) / self.window_s

    def stats(self, now: float, why: str) -> RemoteStats:
        return RemoteStats(
            decode_tokens_per_s=self.rate(now),
            total_generation_tokens=self.total,
            note=f"{why}: server counters n/a; tok/s and TTFT/TPOT measured by this client",
        )
