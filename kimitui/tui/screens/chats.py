"""Pick one of this session's chats."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from kimitui.tui.chat.session import ChatHistory


class ChatsScreen(ModalScreen[int | None]):
    """Dismisses with the chosen chat's id, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, history: ChatHistory) -> None:
        super().__init__()
        self.history = history

    def compose(self) -> ComposeResult:
        options = [
            Option(f"{c.id:>3}  {c.title}  ({len(c.turns)} messages)", id=str(c.id))
            for c in reversed(self.history.chats)
        ]
        with Vertical(id="chats-box"):
            yield Static("chats of this session", classes="modal-title")
            yield OptionList(*options, id="chats-list")
            yield Static("Enter opens · Esc closes", classes="modal-hint")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))
