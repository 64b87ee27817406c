"""Server-sent events, fan-in of several engine streams, and abort-on-disconnect.

A client that goes away must free its KV blocks. Closing an engine generator aborts its request,
so everything here makes sure generators are closed promptly: a streamed response and a
non-streaming request each watch for ``http.disconnect`` and cancel their work when it comes.
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
    """A stream of server-sent events whose headers go out with its first event.

    Served as a plain ASGI loop in the request's task (Starlette's StreamingResponse spends a task
    group and several event-loop turns on each response, about 0.3 ms of TTFT here): the first event
    is awaited before the headers are sent (up to ``HEADERS_WAIT``, then the headers go out alone),
    each event is sent as it comes, and a task of its own waits for the client to go away, which
    cancels the loop (closing ``events`` and the ``owned`` streams aborts their engine requests).
    """

    def __init__(self, events: AsyncIterator[bytes], owned=()):
        self._events = events
        self._owned = [s for s in owned if hasattr(s, "aclose")]
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        state = {"ended": False, "gone": False, "start": None}

        def client_gone(watch: asyncio.Future) -> None:
            if not state["ended"] and not watch.cancelled():
                state["gone"] = True
                task.cancel()

        def headers_now() -> None:
            # The headers wait for the first event: this thread then sends nothing while the engine
            # computes the prefill, whose threads it would otherwise slow (the GIL between kernels,
            # a core for the parallel passes), and the headers and the first event go out back to
            # back. A longer prefill gets its headers after HEADERS_WAIT.
            if state["start"] is None:
                state["start"] = loop.create_task(send(start))

        watch = loop.create_task(_disconnected(receive))
        watch.add_done_callback(client_gone)
        timer = loop.call_later(HEADERS_WAIT, headers_now)
        try:
            async for event in self._events:
                if state["start"] is None:
                    timer.cancel()
                    state["start"] = True
                    await send(start)
                elif state["start"] is not True:
                    await state["start"]
                    state["start"] = True
                await send({"type": "http.response.body", "body": event, "more_body": True})
            timer.cancel()
            headers_now()
            if state["start"] is not True:
                await state["start"]
            state["ended"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+: this cancel is handled here
            if uncancel is not None:
                uncancel()
        finally:
            state["ended"] = True
            timer.cancel()
            watch.cancel()
            # The events and the started streams end whatever happened (the client left, the headers
            # could not be sent): as a task of its own, so a second cancellation cannot cut it short.
            cleanup = asyncio.ensure_future(self._close())
            _CLEANUPS.add(cleanup)
            cleanup.add_done_callback(_CLEANUPS.discard)
            await asyncio.shield(cleanup)

    async def _close(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()
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


class EndSignal(asyncio.Event):
    """An ``asyncio.Event`` that also calls back: the shutdown's end of grace (``ServerState.ended``),
    which each open stream watches without a task or a future of its own per event."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: set = set()

    def set(self) -> None:
        super().set()
        for callback in list(self._callbacks):
            callback()

    def subscribe(self, callback):
        """Call ``callback()`` when the event is set; returns the function that cancels that."""
        self._callbacks.add(callback)
        return lambda: self._callbacks.discard(callback)


async def until_shutdown(ended: EndSignal, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of ``events`` until ``ended`` is set (the shutdown's grace period is over); then
    ``events`` is closed (which aborts its engine requests) and ``shutting_down()`` raised, which
    the streaming handlers send as an error event before ``[DONE]``. The end cancels the wait for
    the next item in place: no task or future per item."""
    if ended.is_set():
        raise shutting_down()
    it = events.__aiter__()
    try:
        waiting: list = [None, False]  # the task waiting for an item; whether the end cancelled it

        def cut() -> None:
            if waiting[0] is not None and not waiting[1]:
                waiting[1] = True
                waiting[0].cancel()

        unsubscribe = ended.subscribe(cut)
        try:
            while not ended.is_set():
                waiting[0] = asyncio.current_task()
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not waiting[1]:
                        raise
                    uncancel = getattr(waiting[0], "uncancel", None)  # Python 3.11+
                    if uncancel is not None:
                        uncancel()
                    break
                finally:
                    waiting[0] = None
                yield item
        finally:
            unsubscribe()
        raise shutting_down()
    finally:
        # Closing ``it`` aborts its engine request, so it must happen even when we are being cancelled
        # (the client went away): a second cancellation of the caller would cut this cleanup short and
        # leave the request generating. It runs as a task of its own.
        cleanup = asyncio.ensure_future(_close_after(None, it))
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
    watcher = asyncio.ensure_future(_disconnected(request.receive))
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


async def _disconnected(receive) -> None:
    """Returns when the client has gone (or the response has been sent: uvicorn then answers
    ``http.disconnect`` too). Call only after the body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass
