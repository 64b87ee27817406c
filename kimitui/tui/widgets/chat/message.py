"""One chat message on screen: the user's prompt, or the assistant's thinking block + answer."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static

from kimitui.tui.formatting import clean


class UserMessage(Static):
    def __init__(self, text: str) -> None:
        # Static with markup off: whatever the user typed is shown literally.
        super().__init__(text, markup=False, classes="user-message")


class AssistantMessage(Vertical):
    """Streams into two Markdown widgets through MarkdownStream (which batches fragments it
    cannot draw in time); the thinking block starts open and folds when the answer begins."""

    def __init__(self, reasoning: str = "", content: str = "", stats: str = "") -> None:
        super().__init__(classes="assistant-message")
        self._reasoning, self._content, self._stats = reasoning, content, stats
        self._streams: dict[str, object] = {}
        self._written = {"reasoning": len(reasoning), "content": len(content)}

    def compose(self) -> ComposeResult:
        with Collapsible(title="thinking", collapsed=bool(self._content), classes="thinking"):
            yield Markdown(clean(self._reasoning), classes="reasoning")
        yield Markdown(clean(self._content), classes="answer")
        yield Static(self._stats, classes="reply-stats", markup=False)

    def on_mount(self) -> None:
        self.query_one(".thinking").display = bool(self._reasoning) or not self._stats

    async def write(self, reasoning: str, content: str) -> None:
        """Show the reply so far; only the text not written yet goes to the streams."""
        for part, text in (("reasoning", reasoning), ("content", content)):
            new = text[self._written[part] :]
            if not new:
                continue
            self._written[part] = len(text)
            if part == "content" and not self._streams.get("content"):
                self.query_one(".thinking", Collapsible).collapsed = True
            stream = self._streams.get(part)
            if stream is None:
                widget = self.query_one(".reasoning" if part == "reasoning" else ".answer", Markdown)
                stream = self._streams[part] = Markdown.get_stream(widget)
            await stream.write(clean(new))

    async def finish(self, reasoning: str, content: str, stats: str, finish_reason: str | None = None) -> None:
        # One full update at the end: a per-fragment append can leave a later-closed code fence
        # rendered wrongly (oterm's finding), the final text is the truth.
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        await self.query_one(".reasoning", Markdown).update(clean(reasoning))
        await self.query_one(".answer", Markdown).update(clean(content) or _empty_answer(reasoning, finish_reason))
        self.query_one(".thinking").display = bool(reasoning)
        self.query_one(".reply-stats", Static).update(stats)


def _empty_answer(reasoning: str, finish_reason: str | None) -> str:
    if reasoning and finish_reason == "length":
        return "*(no answer: still thinking when max tokens was reached; F2 raises the limit)*"
    if finish_reason == "stopped":
        return "*(stopped)*"
    return "*(no answer text)*"
