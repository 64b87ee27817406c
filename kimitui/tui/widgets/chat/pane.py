"""The chat: messages of the current chat, the prompt, and a status line.

While a reply streams, a ~30 Hz timer copies whatever the bridge has gathered since the last
tick into the screen, so the redraw rate does not depend on the token rate.
"""

from __future__ import annotations

import time
from typing import Callable

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from kimitui.tui.bridges.base import Bridge
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.chat.session import ChatHistory, Turn
from kimitui.tui.formatting import ms
from kimitui.tui.messages import ReplyFinished
from kimitui.tui.widgets.chat.message import AssistantMessage, UserMessage
from kimitui.tui.widgets.chat.prompt import PromptInput

FLUSH_HZ = 30
FOLLOW_ROWS = 2  # auto-scroll only if the reader is this close to the bottom


def reply_stats(msg: ReplyFinished, elapsed_s: float | None = None) -> str:
    rate = None
    if msg.tpot:
        rate = 1.0 / msg.tpot
    parts = [
        f"{msg.num_tokens} tokens",
        f"TTFT {ms(msg.ttft)}",
        f"TPOT {ms(msg.tpot)}",
        f"{rate:.1f} tok/s" if rate else "tok/s n/a",
        msg.finish_reason or "?",
    ]
    if msg.error:
        parts.append(msg.error)
    return " · ".join(parts)


class ChatPane(Vertical):
    def __init__(
        self,
        bridge: Bridge,
        history: ChatHistory,
        settings: Callable[[], GenerationSettings],
        welcome: str = "",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.bridge, self.history, self.settings = bridge, history, settings
        self.welcome = welcome
        self._live: AssistantMessage | None = None
        self._timer = None

    def compose(self) -> ComposeResult:
        yield VerticalScroll(self._welcome(), id="messages")
        yield Static("", id="chat-status", markup=False)
        yield PromptInput(id="prompt")

    def on_mount(self) -> None:
        self._timer = self.set_interval(1 / FLUSH_HZ, self._flush, pause=True, name="reply-flush")
        self.show_status()

    # -- sending -------------------------------------------------------------------------
    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if self.bridge.generating:
            self.app.notify("A reply is still streaming: Esc stops it.", severity="warning")
            return
        if not self.bridge.ready:
            self.app.notify("The model is still loading.", severity="warning")
            return
        chat = self.history.current
        chat.turns.append(Turn("user", event.text))
        try:
            self.bridge.send(chat, self.settings(), notify=self)
        except Exception as e:  # bad prompt (too long for max_model_len...): tell, keep the text
            chat.turns.pop()
            self.app.notify(str(e), title="Cannot send", severity="error")
            return
        self.query_one(PromptInput).clear()
        log = self.query_one("#messages", VerticalScroll)
        await log.query("#welcome").remove()
        self._live = AssistantMessage()
        await log.mount_all([UserMessage(event.text), self._live])
        log.scroll_end(animate=False)
        self._timer.resume()

    async def _flush(self) -> None:
        state, live = self.bridge.reply, self._live
        if state is None or live is None:
            return
        log = self.query_one("#messages", VerticalScroll)
        follow = log.max_scroll_y - log.scroll_y <= FOLLOW_ROWS
        await live.write(state.reasoning, state.content)
        elapsed = time.monotonic() - state.started
        self.query_one("#chat-status", Static).update(
            f"generating · {state.num_tokens} tokens · {elapsed:.1f}s · Esc stops"
        )
        if follow:
            log.scroll_end(animate=False)

    async def on_reply_finished(self, msg: ReplyFinished) -> None:
        # Not stopped: the main screen also wants it for the throughput panel.
        self._timer.pause()
        stats = reply_stats(msg)
        chat = next((c for c in self.history.chats if c.id == msg.chat_id), None)
        if chat is not None:
            chat.turns.append(Turn("assistant", msg.content, msg.reasoning, stats))
        if self._live is not None and chat is self.history.current:
            await self._live.finish(msg.reasoning, msg.content, stats, msg.finish_reason)
            self.query_one("#messages", VerticalScroll).scroll_end(animate=False)
        self._live = None
        self.show_status()

    # -- chats ---------------------------------------------------------------------------
    async def show_current(self) -> None:
        """Redraw the messages of ``history.current`` (after new chat / switching chats)."""
        log = self.query_one("#messages", VerticalScroll)
        await log.remove_children()
        widgets = [
            UserMessage(t.content) if t.role == "user" else AssistantMessage(t.reasoning, t.content, t.stats)
            for t in self.history.current.turns
        ]
        await log.mount_all(widgets or [self._welcome()])
        self._live = None
        self.show_status()
        self.query_one(PromptInput).focus()

    def _welcome(self) -> Static:
        return Static(self.welcome, id="welcome", markup=False)

    def show_status(self) -> None:
        s = self.settings()
        n = len(self.history.current.turns)
        thinking = "on" if s.thinking else "off"
        if s.thinking and self.bridge.effort_supported:  # K3: the effort the next reply is asked for
            thinking += f" (effort {s.thinking_effort})"
        self.query_one("#chat-status", Static).update(
            f"chat {self.history.current.id} · {n} messages · thinking {thinking} · "
            f"max {s.max_tokens} tokens · T={s.temperature:g}"
        )
