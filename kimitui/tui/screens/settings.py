"""Generation settings: temperature, top-p, top-k, max tokens, thinking and its effort, system prompt."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, Switch, TextArea

from kimitui.engine.text.xtml.render import THINKING_EFFORTS
from kimitui.tui.chat.generation import GenerationSettings

# (field, label, parse, input type): Textual's Input restricts what can be typed by type.
FIELDS = [
    ("temperature", "temperature (0 = greedy)", float, "number"),
    ("top_p", "top-p (0..1]", float, "number"),
    ("top_k", "top-k (0 = off)", int, "integer"),
    ("max_tokens", "max tokens", int, "integer"),
]


class SettingsScreen(ModalScreen[GenerationSettings | None]):
    """Dismisses with new settings, or None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, current: GenerationSettings, effort_supported: bool = True) -> None:
        """``effort_supported``: the loaded model's chat format takes a thinking effort (Kimi K3)."""
        super().__init__()
        self.current = current
        self.effort_supported = effort_supported

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-box"):
            yield Static("generation settings", classes="modal-title")
            for name, label, _parse, kind in FIELDS:
                with Horizontal(classes="field"):
                    yield Label(label)
                    yield Input(str(getattr(self.current, name)), type=kind, id=f"set-{name}")
            with Horizontal(classes="field"):
                yield Label("thinking")
                yield Switch(self.current.thinking, id="set-thinking")
                yield Label("effort" if self.effort_supported else "effort (K3 only)", id="set-effort-label")
                yield Select(
                    [(e, e) for e in THINKING_EFFORTS],
                    value=self.current.thinking_effort,
                    allow_blank=False,
                    id="set-effort",
                    disabled=not self.effort_supported,
                )
            yield Label("system prompt (empty = the model's default)")
            yield TextArea(self.current.system_prompt, id="set-system", soft_wrap=True)
            yield Static("", id="settings-error", markup=False)
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
            yield Static("Ctrl+S saves · Esc cancels", classes="modal-hint")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_save()

    def action_save(self) -> None:
        values: dict = {}
        try:
            for name, label, parse, _kind in FIELDS:
                raw = self.query_one(f"#set-{name}", Input).value.strip()
                try:
                    values[name] = parse(raw)
                except ValueError:
                    raise ValueError(f"{label}: {raw!r} is not a number") from None
            values["thinking"] = self.query_one("#set-thinking", Switch).value
            values["thinking_effort"] = self.query_one("#set-effort", Select).value
            values["system_prompt"] = self.query_one("#set-system", TextArea).text.strip()
            settings = self.current.with_(**values)
        except ValueError as e:  # GenerationSettings validates through SamplingParams
            self.query_one("#settings-error", Static).update(str(e))
            return
        self.dismiss(settings)
