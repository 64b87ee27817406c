"""Throughput: decode tok/s (sparkline of the last 60 s + current), prefill tok/s, the last
reply's TTFT / TPOT, queue depth and KV cache use. Fed by polling the bridge's stats: the
engine's EngineStats, or a remote server's (same names; a number it does not expose is None and
shows n/a, and its ``note`` says what is missing)."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from kimitui.tui.formatting import NA, ms, num, pct, spark
from kimitui.tui.messages import ReplyFinished

WINDOW_S = 60.0
POINT_EVERY_S = 1.0  # one sparkline point per second: 60 points across the window
REPLY_TREND = 24  # TTFT / TPOT of the last replies, drawn as one line each


class ThroughputPanel(Vertical):
    def __init__(self, clock: Callable[[], float] = time.monotonic, **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock = clock
        self._points: deque[tuple[float, float]] = deque()
        self._last_point = float("-inf")
        self._stats = None
        self._reply: ReplyFinished | None = None
        self._replies: deque[tuple[float | None, float | None]] = deque(maxlen=REPLY_TREND)

    def compose(self) -> ComposeResult:
        yield Static("decode n/a", id="decode-now", markup=False)
        yield Sparkline([0.0], id="decode-spark")
        yield Static("", id="throughput-body", markup=False)

    def on_mount(self) -> None:
        self.border_title = "throughput"
        self._render_body()

    def update_stats(self, stats) -> None:
        """Take one EngineStats snapshot (None before the engine is up)."""
        self._stats = stats
        now = self.clock()
        if stats is not None and now - self._last_point >= POINT_EVERY_S:
            self._last_point = now
            self._points.append((now, stats.decode_tokens_per_s or 0.0))
            while self._points and self._points[0][0] < now - WINDOW_S:
                self._points.popleft()
            # The sparkline auto-scales to min..max; a zero floor keeps an idle engine flat at the bottom.
            self.query_one(Sparkline).data = [0.0] + [v for _, v in self._points]
        self._render_body()

    def update_reply(self, msg: ReplyFinished) -> None:
        self._reply = msg
        self._replies.append((msg.ttft, msg.tpot))
        self._render_body()

    def _render_body(self) -> None:
        s, r = self._stats, self._reply
        decode = num(s.decode_tokens_per_s, ".1f", "tok/s") if s else NA
        peak = max((v for _, v in self._points), default=None)
        self.query_one("#decode-now", Static).update(f"decode {decode}   (60 s peak {num(peak, '.1f')})")
        rate = (1.0 / r.tpot) if r is not None and r.tpot else None
        get = (lambda name: getattr(s, name, None)) if s is not None else (lambda name: None)
        lines = [
            f"prefill      {num(get('prefill_tokens_per_s'), '.1f', 'tok/s')}",
            f"last reply   TTFT {ms(r.ttft) if r else NA}  TPOT {ms(r.tpot) if r else NA}",
            f"             {num(rate, '.1f', 'tok/s')}  {r.num_tokens if r else 0} tokens",
        ]
        if len(self._replies) > 1:  # over time: one mark per reply, oldest left
            ttfts, tpots = [a for a, _ in self._replies], [b for _, b in self._replies]
            lines += [
                f"  TTFT trend {spark(ttfts)}  max {ms(max((v for v in ttfts if v is not None), default=None))}",
                f"  TPOT trend {spark(tpots)}  max {ms(max((v for v in tpots if v is not None), default=None))}",
            ]
        lines += [
            f"requests     {num(get('num_running'), 'd')} running, {num(get('num_waiting'), 'd')} waiting",
            f"KV cache     {pct(get('kv_cache_usage'), fraction=True)} of {num(get('kv_cache_capacity_tokens'), 'd')} tokens",
            f"prefix hits  {pct(get('prefix_cache_hit_rate'), fraction=True)}",
        ]
        if get("latency_window_s") is not None or get("ttft_p50") is not None:  # a server's own histograms
            lines.append(f"server TTFT  p50 {ms(get('ttft_p50'))}  p90 {ms(get('ttft_p90'))}")
            lines.append(f"server TPOT  p50 {ms(get('tpot_p50'))}  p90 {ms(get('tpot_p90'))}")
        if get("note"):
            lines.append(get("note"))
        spec = getattr(s, "spec_decode", None) if s else None
        if spec is not None:  # speculative decoding is on
            per_pos = " ".join(f"{v:.0%}" for v in spec.per_position_rates()[:8]) or NA
            lines += [
                f"spec accept  {pct(spec.acceptance_rate, fraction=True) if spec.num_drafts else NA}  "
                f"mean length {num(spec.acceptance_length, '.2f')}  ({spec.num_drafts} drafts)",
                f"  per pos    {per_pos}",
            ]
        self.query_one("#throughput-body", Static).update("\n".join(lines))
