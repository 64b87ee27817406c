"""Server-sent events, fan-in of several engine streams, and abort-on-disconnect.

A client that goes away must free its KV blocks. Closing an engine generator aborts its request,
so everything here makes sure generators are closed promptly: when Starlette cancels a streaming
response on ``http.disconnect``, and for non-streaming requests by watching for the disconnect
ourselves (Starlette does not cancel those).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from kimitui.server.errors import APIError

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def start_stream(llm, prompt, params, request_id: str):
    """The engine stream of a streamed request, added to the engine now (``AsyncLLM.start``) where
    the engine offers that, else when first read (``generate``): the engine then works on the request
    while the handler finishes and the response's headers go out (0.3-0.5 ms of TTFT here). The
    stream must go to ``sse_response``'s ``owned``, which closes it whatever happens to the response."""
    start = getattr(llm, "start", None)
    return llm.generate(prompt, params, request_id) if start is None else start(prompt, params, request_id)


# How long a streamed response's headers wait for its first event (see _SSEResponse.__call__).
HEADERS_WAIT = 0.05


def sse_response(events: AsyncIterator[bytes], owned=()) -> StreamingResponse:
    """``events`` as server-sent events; ``owned``: engine streams (``start_stream``) that ``events``
    reads, closed (their requests aborted unless finished) once the response has ended, even if
    ``events`` never ran."""
    return _SSEResponse(events, owned)


class _SSEResponse(StreamingResponse):
    """A stream of server-sent events whose first event is asked for before the headers go out.

    Reading a lazy stream starts its engine request (``AsyncLLM.generate``), so starting here puts
    the engine to work at once; the headers then wait for that first event (up to ``HEADERS_WAIT``,
    see ``__call__``) and go out with it.
    """

    def __init__(self, events: AsyncIterator[bytes], owned=()):
        self._events = events
        self._owned = [s for s in owned if hasattr(s, "aclose")]
        self._first = asyncio.ensure_future(events.__anext__())
        super().__init__(self._body(), media_type="text/event-stream", headers=_SSE_HEADERS)

    async def _body(self) -> AsyncIterator[bytes]:
        try:
            first = await self._first
        except StopAsyncIteration:
            return
        yield first
        async for item in self._events:
            yield item

    async def __call__(self, scope, receive, send) -> None:
        try:
            # The headers wait for the first event (up to HEADERS_WAIT): then this thread sends nothing
            # while the engine computes the prefill, whose threads it would otherwise slow (the GIL
            # between kernels, a core for the parallel passes), and the headers and the first event
            # go out back to back. A longer prefill gets its headers after HEADERS_WAIT.
            await asyncio.wait((self._first,), timeout=HEADERS_WAIT)
            await super().__call__(scope, receive, send)
        finally:  # the headers could not be sent (the client left): the started stream still ends
            if not self._first.done() or self._owned:
                cleanup = asyncio.ensure_future(self._close())
                _CLEANUPS.add(cleanup)
                cleanup.add_done_callback(_CLEANUPS.discard)
                await asyncio.shield(cleanup)

    async def _close(self) -> None:
        if not self._first.done():
            await _close_after(self._first, self._events)
        for stream in self._owned:  # a no-op for a stream that finished (or that events closed)
            await stream.aclose()


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as ``(index, item)`` in arrival order.

    The first exception of any stream is raised here. Closing or cancelling this iterator
    closes every stream (which aborts their engine requests).
    """
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, end))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is end:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down: the request was stopped at the end of its grace period "
        "(kimitui serve --shutdown-timeout)",
        code="server_shutting_down",
    )


async def until_shutdown(ended: asyncio.Event, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of ``events`` until ``ended`` is set (the shutdown's grace period is over); then
    ``events`` is closed (which aborts its engine requests) and ``shutting_down()`` raised, which
    the streaming handlers send as an error event before ``[DONE]``."""
    if ended.is_set():
        raise shutting_down()
    it = events.__aiter__()
    stop = asyncio.ensure_future(ended.wait())
    step = None
    try:
        while True:
            step = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise shutting_down()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stop.cancel()
        # Closing ``it`` aborts its engine request, so it must happen even when we are being cancelled
        # (the client went away): anyio cancels every await of a cancelled scope again, which would
        # cut this cleanup short and leave the request generating. It runs as a task of its own.
        cleanup = asyncio.ensure_future(_close_after(step, it))
        _CLEANUPS.add(cleanup)
        cleanup.add_done_callback(_CLEANUPS.discard)
        await asyncio.shield(cleanup)


_CLEANUPS: set[asyncio.Future] = set()  # cleanups that outlive a cancelled caller (kept from the GC)


async def _close_after(step: asyncio.Future | None, it) -> None:
    if step is not None and not step.done():  # cancelled mid-step: the step first, then the generator
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work``; if the client disconnects first, cancel it and return ``(False, None)``; if
    the server's shutdown grace period ends first, cancel it and raise a 503.

    Call only after the body has been read: the next ASGI message is then the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    ended = asyncio.ensure_future(request.app.state.server.ended.wait())
    try:
        await asyncio.wait({task, watcher, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        ended.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        if not watcher.cancelled() and watcher.done():
            return False, None
        raise shutting_down()
    return True, task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
