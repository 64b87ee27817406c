"""Engine counters for the UI and the server: throughput over a sliding window, cache use."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    prefix_cache_hit_rate: float  # fraction of queried prompt tokens found in the cache
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    num_preemptions: int
    kv_cache_capacity_tokens: int
    total_prompt_tokens: int
    total_generation_tokens: int
    num_finished: int
    # speculative decoding's acceptance counters (engine.spec_decode.stats.SpecDecodeStats), None when off
    spec_decode: object | None = None
    # prompt positions run through the model (a prefix-cache hit skips them; preemption reruns them)
    computed_prompt_tokens: int = 0
    # vLLM's prefix_cache_queries / prefix_cache_hits counters: tokens looked up / found at admission
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class ThroughputWindow:
    """Tokens per second over the last ``window_s`` seconds of steps."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._events: deque[tuple[float, int, int]] = deque()  # (t, prefill tokens, decode tokens)

    def record(self, prefill_tokens: int, decode_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, prefill_tokens, decode_tokens))
        self._trim(now)

    def rates(self, now: float | None = None) -> tuple[float, float]:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0, 0.0
        span = max(now - self._events[0][0], 1e-3) if len(self._events) > 1 else self.window_s
        span = min(max(span, 1e-3), self.window_s)
        return (sum(e[1] for e in self._events) / span, sum(e[2] for e in self._events) / span)

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.popleft()
