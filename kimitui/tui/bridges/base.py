"""What the screens need from whatever produces replies and stats: the in-process engine
(``EngineBridge``) or an OpenAI-compatible server (``RemoteBridge``). Screens and widgets talk
to this surface only, so neither knows which one it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from textual.message_pump import MessagePump

from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.chat.session import Chat


@dataclass(frozen=True)
class BenchSource:
    """What the F5 benchmark runs against. ``make_client(config)`` is called on the benchmark's own
    thread and event loop and returns a kimitui.bench client (closed with ``aclose()``);
    ``problem`` says why no benchmark can run now (then the rest may be empty)."""

    model_name: str = ""
    tokenizer: Any = None
    max_model_len: int | None = None
    num_gpus: int = 0
    make_client: Callable[[Any], Any] | None = None
    target: str = "the loaded model"
    problem: str | None = None
    tokenizer_factory: Callable[[], Any] | None = None  # builds ``tokenizer`` on the job's thread

    def resolve_tokenizer(self) -> Any:
        """The tokenizer, built now if it is made on demand (reading one can take seconds)."""
        if self.tokenizer is None and self.tokenizer_factory is not None:
            return self.tokenizer_factory()
        return self.tokenizer


class Bridge(Protocol):
    load_title: str  # the load screen's title: "Loading <model>", "Connecting to <url>"

    def load(self, notify: MessagePump | None = None) -> None:
        """Start loading / connecting; post LoadProgressed*, then EngineReady or EngineFailed."""

    def shutdown(self) -> None:
        """Free everything (engine, threads, connections); called once when the app ends."""

    @property
    def ready(self) -> bool:
        """Whether replies can be sent."""

    @property
    def generating(self) -> bool: ...

    @property
    def effort_supported(self) -> bool:
        """Whether the model takes a thinking effort (K3)."""

    reply: Any  # the ReplyState being streamed (or the last one), read by the chat pane's timer

    def send(self, chat: Chat, settings: GenerationSettings, notify: MessagePump | None = None) -> Any:
        """Start the assistant's reply to ``chat``; ReplyFinished goes to ``notify``. Raises on a
        prompt that cannot be sent (shown as one line, the text stays in the input)."""

    def stop(self) -> bool:
        """Stop the current reply; False when none is streaming."""

    def stats(self) -> Any:
        """The latest throughput snapshot (EngineStats attribute names; None = unknown)."""

    def bench_source(self) -> BenchSource: ...
