"""Engine <-> UI. Owns the ``AsyncLLM``: loads it on a worker thread, streams replies, stops them.

The engine steps on its own thread (AsyncLLM's), so awaiting its stream on the UI loop never
blocks a key press. Reply text is not pushed per token: the bridge keeps the growing reply in a
``ReplyState`` that the chat pane reads on a ~30 Hz timer, so a fast stream costs at most ~30
redraws a second. Only the end of a reply travels as a message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from textual.app import App
from textual.message_pump import MessagePump

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.engine.args import pending_kernel_builds
from kimitui.engine.text.chat_format import ChatFormat, ChatPrompt, chat_format_for
from kimitui.tui.bridges.base import BenchSource
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.chat.model_info import model_info
from kimitui.tui.chat.session import Chat
from kimitui.tui.messages import EngineFailed, EngineReady, LoadProgressed, LoadStage, ReplyFinished

log = logging.getLogger(__name__)

# (engine_args, progress callback) -> a loaded AsyncLLM. Tests pass one that hands out a shared engine.
EngineFactory = Callable[[EngineArgs, Callable], AsyncLLM]
PROGRESS_PERIOD_S = 0.05  # a real checkpoint has ~10^5 tensors; 20 updates a second are plenty


def default_engine_factory(engine_args: EngineArgs, progress: Callable) -> AsyncLLM:
    return AsyncLLM(engine_args=engine_args, progress=progress)


@dataclass
class ReplyState:
    """The reply being generated, written by the stream task and read by the chat pane's timer."""

    chat_id: int
    reasoning: str = ""
    content: str = ""
    num_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    done: bool = False


class EngineBridge:
    """The ``Bridge`` (bridges/base.py) over an ``AsyncLLM`` loaded in this process."""

    def __init__(self, app: App, engine_args: EngineArgs, engine_factory: EngineFactory | None = None) -> None:
        self.app = app
        self.engine_args = engine_args
        self.engine_factory = engine_factory or default_engine_factory
        self.llm: AsyncLLM | None = None
        self.reply: ReplyState | None = None
        self._reply_worker = None
        self.chat_format: ChatFormat | None = None  # the checkpoint's (K2's or K3's XTML), set at load
        self._stop_ids: list[int] = []
        self._keep_ids: list[int] = []

    @property
    def load_title(self) -> str:
        return f"Loading {self.engine_args.model or 'the built-in demo model'}"

    @property
    def ready(self) -> bool:
        return self.llm is not None

    # -- loading -------------------------------------------------------------------------
    def load(self, notify: MessagePump | None = None) -> None:
        """Load the model on a thread; posts LoadProgressed, then EngineReady or EngineFailed to
        ``notify`` (default: the app). ``post_message`` is the thread-safe way into the UI."""
        self.app.run_worker(
            partial(self._load, notify or self.app),
            thread=True,
            group="engine-load",
            exclusive=True,
            exit_on_error=False,
            name="load model",
        )

    def _load(self, notify: MessagePump) -> None:
        last = [0.0]

        def progress(p) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_PERIOD_S or p.tensors_done >= p.tensors_total:
                last[0] = now
                notify.post_message(LoadProgressed(p.bytes_done, p.bytes_total, p.tensors_done, p.tensors_total))

        t0 = time.monotonic()
        try:
            builds = pending_kernel_builds()
            if builds:  # a checkout whose C++ changed, or a wheel built without torch: minutes, not seconds
                notify.post_message(
                    LoadStage(
                        f"Compiling the C++ CPU kernels for this machine first: {', '.join(builds)}, "
                        "once; later starts reuse the build."
                    )
                )
            llm = self.engine_factory(self.engine_args, progress)
            info = model_info(llm, self.engine_args.tensor_parallel_size)
            if llm.tokenizer is not None:
                self.chat_format = chat_format_for(llm.tokenizer)
                self._stop_ids = self.chat_format.stop_token_ids()
                self._keep_ids = self.chat_format.keep_special_ids()
        except Exception as e:  # shown on the load screen; the traceback goes to the log
            log.exception("loading the model failed")
            notify.post_message(EngineFailed(f"{type(e).__name__}: {e}"))
            return
        self.llm = llm
        notify.post_message(EngineReady(info, time.monotonic() - t0))

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # -- replies -------------------------------------------------------------------------
    @property
    def effort_supported(self) -> bool:
        """Whether the loaded model's chat format takes a thinking effort (K3's XTML does)."""
        return self.chat_format is not None and self.chat_format.supports_thinking_effort

    @property
    def generating(self) -> bool:
        return self.reply is not None and not self.reply.done

    def stats(self):
        """The engine's latest EngineStats snapshot, or None before the model is loaded."""
        return self.llm.stats() if self.llm is not None else None

    def send(self, chat: Chat, settings: GenerationSettings, notify: MessagePump | None = None) -> ReplyState:
        """Start generating the assistant's answer to ``chat`` (whose last turn is the user's);
        ``ReplyFinished`` goes to ``notify`` (default: the app) and bubbles up from there."""
        if self.llm is None:
            raise RuntimeError("the model is not loaded yet")
        prompt = self.prompt_for(chat, settings)
        state = ReplyState(chat.id)
        self.reply = state
        self._reply_worker = self.app.run_worker(
            self._stream(state, prompt, notify or self.app, settings),
            group="reply",
            exclusive=True,
            exit_on_error=False,
            name="reply",
        )
        return state

    def bench_source(self) -> BenchSource:
        """The loaded engine, driven in process by kimitui.bench's InProcessClient."""
        llm = self.llm
        if llm is None:
            return BenchSource(problem="The model is not loaded yet.")
        if llm.tokenizer is None:
            return BenchSource(problem="This checkpoint has no tokenizer files, so prompts cannot be built.")
        engine = getattr(llm, "engine", None)
        # Named as `kimitui bench` names an in-process target, so saved runs line up.
        name = self.engine_args.model or getattr(getattr(llm, "config", None), "name", None) or "kimitui-demo"
        # the engine's own GPUs: none when it runs on the CPU (per-GPU numbers are then n/a)
        device = str(getattr(engine, "device", "cpu"))
        num_gpus = 0 if device.startswith("cpu") else self.engine_args.tensor_parallel_size

        def make_client(config):
            from kimitui.bench.clients import InProcessClient

            # Text prompts like `kimitui bench`: the same seed builds the same token ids as a
            # --base-url run against this checkpoint would.
            return InProcessClient(
                llm, model=name, temperature=config.temperature, ignore_eos=config.ignore_eos, text_prompts=True
            )

        return BenchSource(name, llm.tokenizer, getattr(engine, "max_model_len", None), num_gpus, make_client)

    def prompt_for(self, chat: Chat, settings: GenerationSettings) -> ChatPrompt:
        """``chat`` in the loaded model's chat format, with the thinking settings applied."""
        if self.llm is None or self.llm.tokenizer is None or self.chat_format is None:
            raise RuntimeError("this checkpoint has no tokenizer files, so it cannot chat")
        # The effort selector is the K3 option; a K2 model is not handed it (no note per reply).
        effort = settings.thinking_effort if self.effort_supported else None
        return self.chat_format.encode(
            chat.messages(settings.system_prompt), thinking=settings.thinking, thinking_effort=effort
        )

    def stop(self) -> bool:
        """Stop the current reply; its stream's exit aborts the request and frees its KV blocks."""
        if not self.generating or self._reply_worker is None:
            return False
        self._reply_worker.cancel()
        return True

    async def _stream(
        self, state: ReplyState, prompt: ChatPrompt, notify: MessagePump, settings: GenerationSettings
    ) -> None:
        parser = self.chat_format.reply_parser(prompt.started_in_thinking)
        params = settings.sampling_params(self._stop_ids, self._keep_ids)
        ids = prompt.ids
        seen, metrics, finish, error = 0, None, None, None
        try:
            async for out in self.llm.generate({"prompt_token_ids": ids}, params, f"tui-{uuid.uuid4().hex[:12]}"):
                completion = out.outputs[0]
                delta = parser.feed(completion.text[seen:])
                seen = len(completion.text)
                state.reasoning += delta.reasoning
                state.content += delta.content
                state.num_tokens = len(completion.token_ids)
                metrics, finish = out.metrics, completion.finish_reason
        except asyncio.CancelledError:
            finish = "stopped"
        except Exception as e:  # a failed request ends this reply only; the chat goes on
            log.exception("reply failed")
            finish, error = "error", f"{type(e).__name__}: {e}"
        tail = parser.finish()
        state.reasoning += tail.reasoning
        state.content += tail.content
        state.done = True
        notify.post_message(
            ReplyFinished(
                state.chat_id,
                state.reasoning,
                state.content,
                state.num_tokens,
                metrics.ttft if metrics else None,
                metrics.tpot if metrics else None,
                finish,
                error,
            )
        )
