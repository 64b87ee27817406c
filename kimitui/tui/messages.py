"""Messages from the engine bridge and the telemetry thread to the UI.

Floods are avoided two ways: reply text is pulled by a ~30 Hz timer rather than pushed per
token, and progress/telemetry messages ``can_replace`` older queued ones of their kind, so a
slow screen only ever sees the newest (toolong's pattern).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from kimitui.tui.chat.model_info import ModelInfo


@dataclass
class LoadProgressed(Message):
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgressed)


@dataclass
class LoadStage(Message):
    """What the load is doing besides reading weights (compiling the C++ CPU kernels, say)."""

    text: str


@dataclass
class EngineReady(Message):
    info: ModelInfo
    load_seconds: float


@dataclass
class EngineFailed(Message):
    error: str


@dataclass
class ReplyFinished(Message):
    """One reply ended (finished, stopped by the user, or failed: then ``error`` is set)."""

    chat_id: int
    reasoning: str
    content: str
    num_tokens: int
    ttft: float | None
    tpot: float | None
    finish_reason: str | None
    error: str | None = None


@dataclass
class TelemetryUpdated(Message):
    sample: object  # kimitui.telemetry.Sample

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, TelemetryUpdated)
