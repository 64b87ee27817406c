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
        if self._stop.is_set():
            raise EngineDeadError("the engine has been shut down")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._commands.put(("add", request_id, prompt, sampling_params or SamplingParams()))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # consumer went away (disconnect, cancel): free its KV blocks
                self._commands.put(("abort", request_id))

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
