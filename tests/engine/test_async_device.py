"""AsyncLLM's engine thread runs its steps on the engine's device, not on the thread default (GPU 0).

CUDA's current device is per host thread, and Triton launches on the current device: an engine on
``cuda:1`` whose loop runs on a fresh thread would otherwise put every kernel on GPU 0. Without a
GPU, ``torch.cuda.set_device`` / ``current_device`` are replaced by a per-thread record (a new thread
starts at 0, as CUDA's does), and a stand-in engine notes the current device at each step.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import torch

import kimitui.engine.async_llm as async_llm
from kimitui.engine.metrics import EngineStats
from kimitui.engine.outputs import CompletionOutput, RequestOutput


class _PerThreadDevice:
    def __init__(self):
        self._local = threading.local()
        self.calls: list[tuple[str, int]] = []

    def set_device(self, device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        self._local.index = index
        self.calls.append((threading.current_thread().name, index))

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)


class _StepRecorder:
    """The part of LLMEngine that AsyncLLM uses; each step finishes every request and records the
    current device it ran under."""

    def __init__(self, device: torch.device, fake: _PerThreadDevice):
        self.device, self.fake = device, fake
        self.tokenizer, self.config = None, SimpleNamespace()
        self.pending: list[str] = []
        self.step_devices: list[int] = []

    def stats(self):
        return EngineStats(0, 0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0)

    def add_request(self, rid, prompt, params):
        self.pending.append(rid)

    def abort_request(self, rid):
        if rid in self.pending:
            self.pending.remove(rid)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def request_ids(self):
        return list(self.pending)

    def step(self):
        self.step_devices.append(torch.cuda.current_device())
        done, self.pending = self.pending, []
        return [RequestOutput(rid, None, [1], None, [CompletionOutput(0, "", [2], "length")], True) for rid in done]

    def shutdown(self):
        pass


def test_engine_thread_selects_the_engine_device(monkeypatch):
    fake = _PerThreadDevice()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    recorder = _StepRecorder(torch.device("cuda", 1), fake)
    monkeypatch.setattr(async_llm, "LLMEngine", lambda args, progress=None: recorder)
    fake.set_device(1)  # what LLMEngine does on the thread that builds it

    llm = async_llm.AsyncLLM(engine_args=SimpleNamespace())
    try:

        async def one():
            return [out async for out in llm.generate([1], request_id="r")]

        outs = asyncio.run(asyncio.wait_for(one(), timeout=30))
    finally:
        llm.shutdown()
    assert outs[-1].finished
    assert recorder.step_devices == [1]  # GPU 1, not the engine thread's default GPU 0
    assert ("kimitui-engine", 1) in fake.calls


def test_cpu_engine_thread_never_touches_cuda(monkeypatch):
    fake = _PerThreadDevice()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    recorder = _StepRecorder(torch.device("cpu"), fake)
    monkeypatch.setattr(async_llm, "LLMEngine", lambda args, progress=None: recorder)
    llm = async_llm.AsyncLLM(engine_args=SimpleNamespace())
    llm.shutdown()
    assert fake.calls == []
