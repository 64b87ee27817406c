"""AsyncLLM: the engine loop in its own thread, asyncio streaming of cumulative outputs."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

import torch

from kimitui.engine.args import EngineArgs
from kimitui.engine.engine import LLMEngine
from kimitui.engine.metrics import EngineStats
from kimitui.engine.outputs import RequestOutput
from kimitui.engine.parallel.workers import WorkerError
from kimitui.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed while running this request; the engine itself keeps serving."""


class RequestStream:
    """One request's cumulative outputs (``AsyncLLM.start``): an async iterator that ends after the
    finished output and raises the engine's error for the request; ``aclose()`` before the end
    aborts the request (frees its KV blocks)."""

    def __init__(self, llm: AsyncLLM, request_id: str, q: asyncio.Queue):
        self.request_id = request_id
        self._llm, self._q, self._ended = llm, q, False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    async def aclose(self) -> None:
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if self._ended:
            return
        self._ended = True
        self._llm._streams.pop(self.request_id, None)
        if abort:  # the consumer went away (disconnect, cancel): free its KV blocks
            self._llm._commands.put(("abort", self.request_id))


class AsyncLLM:
    """Same constructor as ``LLM``; ``async for out in engine.generate(prompt, params, request_id)``.

    Only the engine thread touches the engine: adds and aborts travel through a command queue and
    outputs come back through per-request asyncio queues, so a step never blocks the event loop.
    """

    def __init__(self, model: str | None = None, *, engine_args: EngineArgs | None = None, progress=None, **kwargs):
        args = engine_args or EngineArgs(model=model, **kwargs)
        self.engine = LLMEngine(args, progress)
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = self.engine.stats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kimitui-engine", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------------
    async def generate(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs; it is added to the engine when the stream is first read."""
        stream = self.start(prompt, sampling_params, request_id)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    def start(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """``generate`` with the request added to the engine now, not at the first read: a server
        handler calls this once it has validated a request, so the engine works on it while the
        response is being set up. The caller must read the stream to its end or ``aclose()`` it
        (which aborts the request); call it from the event loop that reads it."""
        if self._stop.is_set():
            raise EngineDeadError("the engine has been shut down")
        request_id = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", request_id, prompt, sampling_params or SamplingParams()))
        return RequestStream(self, request_id, q)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running (False after shutdown or a fatal error)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its latest step."""
        return self._stats

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if engine.device.type == "cuda":
            # The current device is per thread (a new one starts on GPU 0) and Triton launches, like
            # graph capture's stream, on the current device: select the engine's here as well.
            torch.cuda.set_device(engine.device)
        while not self._stop.is_set():
            block = not engine.has_unfinished_requests()
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not engine.has_unfinished_requests():
                self._stats = engine.stats()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a failed step must not take the server down
                log.exception("engine step failed")
                self._fail_all(e)
                if isinstance(e, WorkerError):  # a lost rank cannot come back: stop for good
                    self._stop.set()
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            self._stats = engine.stats()
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params = cmd
            if rid not in self._streams:
                return  # the consumer left before the request started
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:
                self._deliver(rid, e)
        elif cmd[0] == "abort":
            self.engine.abort_request(cmd[1])

    def _deliver(self, rid: str, item) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self.engine.abort_request(rid)
            return
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed
            self.engine.abort_request(rid)

    def _fail_all(self, error: BaseException) -> None:
        for rid in self.engine.request_ids():
            self.engine.abort_request(rid)
            self._deliver(rid, EngineDeadError(f"request {rid} failed: {error}"))
