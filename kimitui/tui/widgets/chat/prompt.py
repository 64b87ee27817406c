"""The multi-line prompt: Enter sends, Shift+Enter or Ctrl+J inserts a newline.

Many terminals send the same byte for Enter and Shift+Enter, so Ctrl+J (a plain line feed,
which every terminal can send) is the newline key that always works.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    # Priority: TextArea's own key handler would otherwise turn Enter into a newline first.
    BINDINGS = [
        Binding("enter", "submit", "Send", priority=True),
        Binding("shift+enter,ctrl+j", "newline", "Newline", key_display="⇧⏎/^J", priority=True),
    ]

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kwargs) -> None:
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            placeholder="Message the model (Enter sends, Shift+Enter or Ctrl+J: newline)",
            **kwargs,
        )

    def action_submit(self) -> None:
        # The priority binding sees Enter before this widget has handled the keys queued ahead of
        # it: typed (or pasted) quickly, "Hello" + Enter would read "H" or nothing. Reading the
        # text from this widget's own queue, after those keys, sends what was typed.
        self.call_later(self._submit_text)

    def _submit_text(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        self.insert("\n")
