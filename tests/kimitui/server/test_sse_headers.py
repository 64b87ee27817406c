"""A streamed response's headers wait for its first event (kimitui/server/streaming.py HEADERS_WAIT): the
server thread stays idle while the engine computes the prefill, then sends the headers and the first event
back to back; a first event slower than the cap gets its headers at once, as before."""

from __future__ import annotations

import asyncio
import time

from kimitui.server import streaming


async def _run(first_delay: float) -> list[tuple[str, float]]:
    async def events():
        await asyncio.sleep(first_delay)
        yield b"data: first\n\n"
        yield b"data: [DONE]\n\n"

    sent: list[tuple[str, float]] = []
    t0 = time.perf_counter()

    async def send(message):
        sent.append((message["type"], time.perf_counter() - t0))

    async def receive():
        await asyncio.sleep(10)  # no disconnect
        return {"type": "http.disconnect"}

    response = streaming.sse_response(events())
    await response({"type": "http", "method": "POST", "path": "/"}, receive, send)
    return sent


def test_headers_go_out_with_a_quick_first_event():
    sent = asyncio.run(_run(0.005))
    kinds = [k for k, _ in sent]
    assert kinds[0] == "http.response.start" and kinds[1] == "http.response.body"
    start, first_body = sent[0][1], sent[1][1]
    assert start >= 0.004  # not before the first event was ready
    assert first_body - start < 0.03  # then back to back (no second wait)


def test_a_slow_first_event_gets_its_headers_at_the_cap():
    sent = asyncio.run(_run(0.4))
    start, first_body = sent[0][1], sent[1][1]
    assert streaming.HEADERS_WAIT * 0.9 <= start < 0.3  # headers at the cap, not after the first event
    assert first_body >= 0.39
